"""Other engines measured in the same run, on the same weights, prompts and limits (greedy,
batch 1): Hugging Face transformers (``prompt_lookup_num_tokens``) and llama-cpp-python
(``LlamaPromptLookupDecoding``). Each peer's speedup is over its own plain decoding, set beside
ours. Peers are optional: a missing package is skipped with a note, never an error.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
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

    def __init__(self, dtype: Any = None, threads: int | None = None) -> None:
        self._model: Any = None
        self.dtype = dtype

    def unavailable(self, source: Path) -> str | None:
        for pkg in ("transformers", "accelerate") if source.suffix == ".gguf" else ("transformers",):
            if importlib.util.find_spec(pkg) is None:
                return f"{pkg} is not installed (pip install 'specdraft[test]')"
        return None

    def _load(self, source: Path) -> Any:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            dtype = self.dtype or torch.float32
            if source.is_dir():
                self._model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
            else:
                self._model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
            self._model.eval()
        return self._model

    def bind(self, source: Path) -> "TransformersPeer":
        self._load(source)
        return self

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, speculative: bool) -> PeerRun:
        import torch

        model = self._model
        extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if speculative else {}
        new_tokens = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([list(p)])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=model.generation_config.eos_token_id, **extra)
                new_tokens += out.shape[1] - ids.shape[1]
        return PeerRun(time.perf_counter() - t0, new_tokens)


class LlamaCppPeer:
    name = "llama.cpp"

    def __init__(self, threads: int | None = None) -> None:
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

        # room past the model's context for prompt + new tokens + the lookup's draft tokens
        common = {"model_path": str(source), "n_ctx": 8192 + 256, "verbose": False, "logits_all": True,
                  "n_threads": self.threads}
        self._plain = Llama(**common)
        self._spec = Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS))
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


PEERS = {"transformers": TransformersPeer, "llamacpp": LlamaCppPeer}
