"""Other engines measured in the same run, on the same weights, prompts and limits (greedy,
batch 1): Hugging Face transformers (``prompt_lookup_num_tokens``; and ``assistant_model``
with the run's own draft model, as peer ``transformers-draft``) and llama-cpp-python
(``LlamaPromptLookupDecoding``). Each peer's speedup is over its own plain decoding, set beside
ours. Peers are optional: a missing package is skipped with a note, never an error.

Each peer is measured in its own process (``python -m specdraft.bench.peers``, a JSON job on
stdin, one JSON line per result on stdout), so that a peer that crashes the interpreter (a
native library can) costs only its own rows, reported as a note.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

PROMPT_LOOKUP_TOKENS = 10  # both peers' documented default draft length for prompt lookup


@dataclass(frozen=True, slots=True)
class PeerRun:
    seconds: float
    new_tokens: int


class Peer(Protocol):
    name: str

    def unavailable(self, source: Path) -> str | None:
        """None when the peer can run on this model, else why not (one line)."""

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, speculative: bool) -> PeerRun: ...


class TransformersPeer:
    name = "transformers"
    mode = "prompt lookup"

    def __init__(self, dtype: Any = None, threads: int | None = None, assistant: str | None = None) -> None:
        self._model: Any = None
        self._assistant: Any = None
        self.dtype = dtype
        self.threads = threads
        self.assistant = assistant

    def unavailable(self, source: Path) -> str | None:
        for pkg in ("transformers", "accelerate") if source.suffix == ".gguf" else ("transformers",):
            if importlib.util.find_spec(pkg) is None:
                return f"{pkg} is not installed (pip install 'specdraft[test]')"
        return None

    def _from(self, source: Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = self.dtype or torch.float32
        if self.threads:
            torch.set_num_threads(self.threads)
        if source.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
        return model.eval()

    def bind(self, source: Path) -> "TransformersPeer":
        self._model = self._from(source)
        return self

    def speculative_kwargs(self) -> dict[str, Any]:
        """What ``generate`` gets on top of plain decoding: prompt lookup (the run's draft
        model, if any, is only for ``transformers-draft``)."""
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, speculative: bool) -> PeerRun:
        import torch

        model = self._model
        extra = self.speculative_kwargs() if speculative else {}
        new_tokens = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([list(p)])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=model.generation_config.eos_token_id, **extra)
                new_tokens += out.shape[1] - ids.shape[1]
        return PeerRun(time.perf_counter() - t0, new_tokens)


class TransformersDraftPeer(TransformersPeer):
    """transformers' assisted generation with the run's own draft model (``draft:path=...``)."""

    name = "transformers-draft"
    mode = "draft model"

    def unavailable(self, source: Path) -> str | None:
        if not self.assistant:
            return "needs a draft model: add a 'draft:path=...' method to the run"
        return super().unavailable(source)

    def bind(self, source: Path) -> "TransformersDraftPeer":
        super().bind(source)
        assert self.assistant is not None  # unavailable() said so otherwise
        self._assistant = self._from(Path(self.assistant))
        return self

    def speculative_kwargs(self) -> dict[str, Any]:
        return {"assistant_model": self._assistant}


class LlamaCppPeer:
    name = "llama.cpp"
    mode = "prompt lookup"

    def __init__(self, threads: int | None = None, assistant: str | None = None) -> None:
        self.threads = threads
        self._plain: Any = None
        self._spec: Any = None

    def unavailable(self, source: Path) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed (bash scripts/setup.sh --peers builds it, ~4 minutes)"
        if source.suffix != ".gguf":
            return "llama.cpp needs a GGUF file"
        return None

    def bind(self, source: Path) -> "LlamaCppPeer":
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # the model's own context (n_ctx 0 = as trained): prompts are cut to leave room for the new
        # tokens and the draft, and llama.cpp warns about an n_ctx past the trained one. Threads:
        # the run's (llama.cpp's own default is half the cores). Plain decoding as a user runs it;
        # prompt lookup needs logits for every position (it crashes without once the prompt
        # passes n_batch), which costs plain decoding ~5% here.
        common = {"model_path": str(source), "n_ctx": 0, "verbose": False, "n_threads": self.threads}
        self._plain = Llama(**common)
        self._spec = Llama(**common, logits_all=True,
                           draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS))
        return self

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, speculative: bool) -> PeerRun:
        llm = self._spec if speculative else self._plain
        new_tokens = 0
        t0 = time.perf_counter()
        for p in prompts:
            llm.reset()
            out = llm.create_completion(prompt=list(p), max_tokens=max_new_tokens, temperature=0.0, top_k=1)
            new_tokens += int(out["usage"]["completion_tokens"])
        return PeerRun(time.perf_counter() - t0, new_tokens)


PEERS = {"transformers": TransformersPeer, "transformers-draft": TransformersDraftPeer, "llamacpp": LlamaCppPeer}


def measure_peer(name: str, source: Path, workloads: dict[str, list[list[int]]], max_new_tokens: int,
                 emit: Callable[[dict[str, Any]], None], assistant: str | None = None,
                 threads: int | None = None) -> None:
    """Plain and speculative decoding of peer ``name`` on each workload's prompts (batch 1).
    Emits one row per workload, or a single {"note": ...} when the peer cannot run.
    ``assistant``: the draft model for ``transformers-draft``; ``threads``: the run's CPU threads."""
    peer = PEERS[name](assistant=assistant, threads=threads)
    reason = peer.unavailable(source)
    if reason is not None:
        emit({"note": f"skipped: {reason}"})
        return
    try:
        peer.bind(source)
    except Exception as e:  # a peer failing to load is reported, not fatal
        emit({"note": f"skipped: failed to load ({type(e).__name__}: {e})"})
        return
    first = next(iter(workloads.values()))[0]
    peer.run([first], 8, False)  # warm-up
    peer.run([first], 8, True)
    for w, prompts in workloads.items():
        plain = peer.run(prompts, max_new_tokens, False)
        spec = peer.run(prompts, max_new_tokens, True)
        plain_tps, spec_tps = plain.new_tokens / plain.seconds, spec.new_tokens / spec.seconds
        emit({"peer": name, "mode": peer.mode, "workload": w, "batch": 1, "requests": len(prompts),
              "plain_tokens_per_s": plain_tps, "speculative_tokens_per_s": spec_tps,
              "speedup": spec_tps / plain_tps, "plain_new_tokens": plain.new_tokens,
              "speculative_new_tokens": spec.new_tokens})


def measure_isolated(job: dict[str, Any], emit: Callable[[dict[str, Any]], None],
                     argv: Sequence[str] | None = None) -> str:
    """Run ``measure_peer`` for ``job`` in a child process; its rows go to ``emit`` as they
    arrive. Returns the peer's note ("ok", a skip reason, or how the process died)."""
    cmd = list(argv) if argv is not None else [sys.executable, "-m", "specdraft.bench.peers"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    note, rows = "ok", 0
    for line in proc.stdout:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue  # a native library's chatter on stdout
        if isinstance(msg, dict) and "note" in msg:
            note = str(msg["note"])
        elif isinstance(msg, dict):
            rows += 1
            emit(msg)
    err = proc.stderr.read() if proc.stderr is not None else ""
    code = proc.wait()
    if code != 0:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        last = err.strip().splitlines()[-1] if err.strip() else ""
        note = f"crashed ({how}) after {rows} workload(s)" + (f": {last}" if last else "")
    return note


def _main() -> int:
    job = json.load(sys.stdin)
    workloads = {w: [list(p) for p in ps] for w, ps in job["workloads"].items()}

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    measure_peer(job["peer"], Path(job["source"]), workloads, int(job["max_new_tokens"]), emit, job.get("assistant"),
                 job.get("threads"))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
