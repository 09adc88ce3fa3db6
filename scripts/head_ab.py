"""A/B of a feature head's draft step from C++ against its Python layer (results/trained-heads/mtp-cost/ab-cpp.log):
bfloat16, batch 1, adaptive policy (k <= 8), the first 4 chat and qa prompts, 96 tokens, two rounds, engines
interleaved per prompt.

    .venv/bin/python scripts/head_ab.py mtp [bfloat16|float32|int4] [bi]
"""
import sys, time, torch
from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.model.loader import load
from specdraft.sequence import GenerationConfig
from specdraft.metrics import SpecStats
torch.set_num_threads(2)
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
loaded = load(dtype=dtype, batch_invariant=len(sys.argv) > 3 and sys.argv[3] == "bi")
gen = GenerationConfig(max_new_tokens=96)
method = sys.argv[1] if len(sys.argv) > 1 else "mtp"
for w, msgs in workload_messages(("chat", "qa")).items():
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[:4]]
    engines = {"plain": build_engine(loaded, "plain"), "cpp": build_engine(loaded, method, k=8), "python": build_engine(loaded, method, k=8)}
    engines["python"].proposer.fast = None
    assert engines["cpp"].proposer.fast is not None
    for e in engines.values():
        e.generate([prompts[0]], GenerationConfig(max_new_tokens=8))
    res = {n: [0.0, 0, SpecStats()] for n in engines}
    for rep in range(2):
        for p in prompts:
            for name, e in engines.items():
                t = time.perf_counter(); r = e.generate([p], gen, stats=res[name][2])[0]
                res[name][0] += time.perf_counter() - t; res[name][1] += len(r.tokens)
    base = res["plain"][1] / res["plain"][0]
    for name, (s, n, st) in res.items():
        print(f"{w:6s} {method} {dtype}{'-bi' if loaded.model.batch_invariant else ''} {name:7s} {n/s:6.1f} tok/s {n/s/base:.2f}x tau {st.tau:.2f} propose {st.propose_s:.2f} s verify {st.verify_s:.2f} s steps {st.steps} ({1e3*st.propose_s/max(st.steps,1):.1f} ms/step)")
