"""Batched exactness: 16 prompts (code, summarization, chat) in one static batch, suffix with the
adaptive policy against plain: row by row in bfloat16 --batch-invariant (`bfloat16 bi`), or one
plain batch in another mode (`float32 no`). Prints how many rows are identical.

    .venv/bin/python scripts/batched_check.py bfloat16 bi [method, default suffix]
"""
import sys, torch
from specdraft.api import build_engine
from specdraft.model.loader import load
from specdraft.bench.serve import workload_messages
from specdraft.sequence import GenerationConfig
torch.set_num_threads(2)
dtype, bi = sys.argv[1], sys.argv[2] == "bi"
loaded = load(dtype=dtype, batch_invariant=bi) if bi else load(dtype=dtype)
msgs = []
for w in ("code", "summarization", "chat"):
    [m] = workload_messages((w,)).values(); msgs += m[:6]
prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}])[:400] for m in msgs[:16]]
gen = GenerationConfig(max_new_tokens=48)
plain = build_engine(loaded, "plain")
ref = [plain.generate([p], gen)[0] for p in prompts] if bi else plain.generate(prompts, gen)
spec = build_engine(loaded, sys.argv[3] if len(sys.argv) > 3 else "suffix")
out = spec.generate(prompts, gen)
same = sum(list(a.tokens) == list(b.tokens) for a, b in zip(ref, out))
print(f"{dtype} bi={bi}: {same}/{len(prompts)} identical")
