"""Batch 1, bfloat16: plain decoding against the MTP module under the fixed tree (k = 8) and the adaptive
policy, on the first 4 prompts of each workload, 96 tokens, engines interleaved per prompt; prints
speed, tau and the propose / verify seconds (results/trained-heads/mtp-cost/).

    .venv/bin/python scripts/head_cost.py chat,qa
"""
import sys, time
import torch
from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.model.loader import load
from specdraft.sequence import GenerationConfig
from specdraft.metrics import SpecStats
torch.set_num_threads(2)
loaded = load(dtype="bfloat16")
gen = GenerationConfig(max_new_tokens=96)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["chat", "qa"]
for w, msgs in workload_messages(tuple(workloads)).items():
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[:4]]
    engines = {"plain": build_engine(loaded, "plain"),
               "mtp-fixed": build_engine(loaded, "mtp", k=8, policy="fixed"),
               "mtp-adaptive": build_engine(loaded, "mtp", k=8)}
    for e in engines.values():
        e.generate([prompts[0]], GenerationConfig(max_new_tokens=8))  # warm
    res = {n: [0.0, 0, SpecStats()] for n in engines}
    for p in prompts:
        for name, e in engines.items():  # interleaved per prompt
            t = time.perf_counter()
            r = e.generate([p], gen, stats=res[name][2])[0]
            res[name][0] += time.perf_counter() - t
            res[name][1] += len(r.tokens)
    base = res["plain"][1] / res["plain"][0]
    for name, (s, n, st) in res.items():
        print(f"{w:10s} {name:13s} {n / s:6.1f} tok/s  {n / s / base:.2f}x  tau {st.tau:.2f}  propose {st.propose_s:.2f} "
              f"verify {st.verify_s:.2f} s  ({st.steps} steps: {1e3 * st.propose_s / st.steps:.1f} + "
              f"{1e3 * st.verify_s / st.steps:.1f} ms per step)")
