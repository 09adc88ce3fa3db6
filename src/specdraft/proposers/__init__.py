"""The registry of methods: a name, a proposer factory and its settings dataclass.

A method's settings are the fields of its frozen config dataclass; ``make_proposer`` builds
one from ``key=value`` strings (as the CLI's ``--opt`` passes them) and refuses unknown keys.
A factory is called as ``factory(config, context)``: the context gives the target model and
tokenizer to the proposers that need them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.proposers.base import NoDraft, Proposer, ProposerContext
from specdraft.proposers.ngram import NgramConfig, NgramProposer
from specdraft.proposers.draft_model import DraftModelConfig, make_draft_proposer
from specdraft.proposers.layer_skip import LayerSkipConfig, make_layer_skip_proposer
from specdraft.proposers.retrieval import RestConfig, RestProposer
from specdraft.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdraft.proposers.feature_heads import EagleOptions, MtpOptions, eagle_from_context, mtp_from_context
from specdraft.proposers.medusa import MedusaOptions, MedusaProposer
from specdraft.proposers.suffix import SuffixConfig, SuffixProposer


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    summary: str
    config_type: type | None
    factory: Callable[[Any, ProposerContext | None], Proposer]


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("plain", "no speculation: one token per target pass (the baseline)", None, lambda _c, _x: NoDraft()),
        Method("ngram", "prompt lookup: propose what followed the current suffix earlier in the context",
               NgramConfig, lambda c, _x: NgramProposer(c)),
        Method("draft", "draft model: a smaller model with the same vocabulary drafts a chain (or a first-level tree)",
               DraftModelConfig, make_draft_proposer),
        Method("layer-skip", "self-speculation: the target's first layers (early exit) draft a chain; no extra weights",
               LayerSkipConfig, make_layer_skip_proposer),
        Method("lookahead", "lookahead decoding: a Jacobi window guessed in the verification pass feeds an n-gram pool; pool n-grams are verified",
               LookaheadConfig, lambda c, _x: LookaheadProposer(c)),
        Method("rest", "retrieval (REST): propose what followed the context's suffix in a datastore built from a corpus",
               RestConfig, RestProposer.from_context),
        Method("medusa", "Medusa heads: trained heads on the target's last hidden state guess the next K tokens (chain or tree)",
               MedusaOptions, MedusaProposer.from_context),
        Method("eagle", "EAGLE-3 head: one trained layer over the target's fused low/mid/high features drafts EAGLE-2 dynamic trees (topk=1: a chain)",
               EagleOptions, eagle_from_context),
        Method("mtp", "multi-token prediction: a DeepSeek-V3-style MTP module (trained here, or the target's own) chained for several tokens",
               MtpOptions, mtp_from_context),
        Method("suffix", "suffix decoding: the most frequent continuations of the longest matching suffix (this request and earlier outputs) as a tree",
               SuffixConfig, SuffixProposer.from_context),
    )
}


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SpecdraftError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def make_proposer(
    name: str, options: Mapping[str, str] | None = None, context: ProposerContext | None = None
) -> Proposer:
    """Build the proposer of method ``name``. ``context`` is required by the methods that use
    the target model (they raise a SpecdraftError without it)."""
    method = get_method(name)
    options = dict(options or {})
    if method.config_type is None:
        if options:
            raise SpecdraftError(f"method {name!r} takes no options, got {', '.join(options)}")
        return method.factory(None, context)
    return method.factory(parse_options(method.config_type, options, name), context)


def parse_options(config_type: type, options: Mapping[str, str], name: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    values: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in fields:
            raise SpecdraftError(f"method {name!r} has no option {key!r}; options: {', '.join(fields)}")
        default = fields[key].default
        values[key] = _convert(raw, type(default), f"{name} option {key}")
    return config_type(**values)


def _convert(raw: str, kind: type, what: str) -> Any:
    try:
        if kind is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise SpecdraftError(f"{what} must be a {kind.__name__}, got {raw!r}") from None


def describe_methods() -> str:
    lines = []
    for m in METHODS.values():
        lines.append(f"{m.name}: {m.summary}")
        if m.config_type is not None:
            doc = " ".join((m.config_type.__doc__ or "").split())
            opts = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(m.config_type))
            lines.append(f"    options: {opts}")
            if doc:
                lines.append(f"    {doc}")
    return "\n".join(lines)
