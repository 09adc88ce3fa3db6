"""The OpenAI request bodies the server accepts, and their translation into a prompt, limits
and sampling settings. Unknown fields are refused (a typo must not be silently ignored);
fields of OpenAI's API that change the output and are not implemented are refused by name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specdraft.errors import SpecdraftError
from specdraft.model.tokenizer import Tokenizer
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16


class BadRequest(SpecdraftError):
    """A request the server refuses with status 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields shared by both endpoints. ``top_k`` and ``ignore_eos`` are extensions (as in
    vLLM); the rest is OpenAI's API. temperature defaults to 1 as in OpenAI's API (0 = greedy)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise BadRequest(f"only n = 1 is supported, got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise BadRequest(f"{name} is not supported (it must be 0)", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream = true", "stream_options")

    def sampling(self) -> Sampling:
        try:
            return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
        except SpecdraftError as e:
            param = next((p for p in ("temperature", "top_k", "top_p", "seed") if p in str(e)), None)
            raise BadRequest(str(e), param) from None

    def limits(self, max_tokens: int) -> GenerationConfig:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise BadRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        return GenerationConfig(max_new_tokens=max_tokens, stop=tuple(stops), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported", name)
        if self.best_of not in (None, 1):
            raise BadRequest("best_of is not supported", "best_of")

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise BadRequest(f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("the prompt is empty", "prompt")
            return tokenizer.encode(prompt)
        if not prompt:
            raise BadRequest("the prompt is empty", "prompt")
        return list(prompt)  # type: ignore[arg-type]

    def max_new(self, prompt_tokens: int, context: int) -> int:
        return COMPLETION_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise BadRequest("logprobs is not supported", "logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        return tokenizer.encode_chat(messages)

    def max_new(self, prompt_tokens: int, context: int) -> int:
        """Given, or as OpenAI: whatever the context leaves."""
        given = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return given if given is not None else max(1, context - prompt_tokens)
