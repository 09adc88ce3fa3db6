"""Retrieval-based speculative decoding (REST, He et al. 2023).

Drafts come from a datastore built once from a corpus (:mod:`specdraft.datastore`), not from
the context: the longest suffix of the context (max_suffix tokens down to min_suffix) is looked
up in the corpus's suffix array, the tokens that followed up to ``max_matches`` of its
occurrences are merged into a trie with counts, and the most frequent nodes (at most the
budget, parents before children) become the draft tree. Drafts are deterministic (p_draft None)
and depend on the context only, so sampling stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specdraft.accept import Acceptance
from specdraft.datastore import Datastore, DatastoreError, default_datastore_path, load
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import ProposerContext, Verified
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RestConfig:
    """datastore: a file from `specdraft datastore build` ("" = the Python standard-library
    datastore for the target's tokenizer, in $SPECDRAFT_DATASTORES or
    ~/.cache/specdraft/datastores). max_suffix / min_suffix: longest and shortest context
    suffix looked up. max_matches: occurrences read per lookup (spread over all of them);
    their continuations merge into a tree, most frequent nodes first."""

    datastore: str = ""
    max_suffix: int = 16
    min_suffix: int = 1
    max_matches: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_suffix <= self.max_suffix <= 64:
            raise SpecdraftError(f"rest: need 1 <= min_suffix <= max_suffix <= 64, got min_suffix="
                                 f"{self.min_suffix}, max_suffix={self.max_suffix}")
        if not 1 <= self.max_matches <= 4096:
            raise SpecdraftError(f"rest: max_matches must be in 1..4096, got {self.max_matches}")


def frequency_tree(paths: Seq[Seq[int]], budget: int, label: str = "") -> Draft:
    """Merge token paths into a trie where each node counts the paths through it, and keep the
    ``budget`` most frequent nodes. Ties go to the shallower node, then to the first seen; since
    a node is never more frequent than its parent, that order keeps parents before children
    and is the draft's node order (the most frequent continuation comes first)."""
    counts: dict[tuple[int, ...], int] = {}  # path prefix -> paths through it, first seen first
    for path in paths:
        for depth in range(1, len(path) + 1):
            prefix = tuple(path[:depth])
            counts[prefix] = counts.get(prefix, 0) + 1
    chosen = sorted(counts, key=lambda p: (-counts[p], len(p)))[: max(budget, 0)]
    node = {prefix: i for i, prefix in enumerate(chosen)}
    parents = tuple(node[p[:-1]] if len(p) > 1 else -1 for p in chosen)
    return Draft(tuple(p[-1] for p in chosen), parents, label=label)


def match_label(suffix: int) -> str:
    """The draft's label for the adaptive policy: the matched suffix length, long ones pooled
    (a few labels gather evidence faster than fifteen)."""
    return f"rest{suffix}" if suffix < 5 else ("rest5-7" if suffix < 8 else "rest8+")


class RestProposer:
    name = "rest"

    def __init__(self, datastore: Datastore, config: RestConfig | None = None) -> None:
        self.datastore = datastore
        self.config = config or RestConfig()

    @classmethod
    def from_context(cls, config: RestConfig | None, context: ProposerContext | None) -> "RestProposer":
        """Open the configured datastore (checked against the target's tokenizer)."""
        config = config or RestConfig()
        if context is None:
            raise SpecdraftError("rest needs the target's tokenizer (build it with build_engine or a ProposerContext)")
        if config.datastore:
            return cls(load(config.datastore, context.tokenizer), config)
        path = default_datastore_path(context.tokenizer)
        if not path.is_file():
            raise DatastoreError(f"rest: no datastore at {path}; build it with `specdraft datastore build --stdlib` "
                                 "(add --model PATH for another model) or pass --opt datastore=FILE")
        return cls(load(path, context.tokenizer), config)

    def begin(self, row: int, seq: Sequence) -> None:
        pass  # no per-row state: a draft depends on the row's context only

    def end(self, row: int) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass  # no per-row state

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        c = self.config
        drafts = []
        for seq, budget in zip(seqs, budgets):
            if seq is None or budget <= 0:
                drafts.append(Draft.empty())
                continue
            found = self.datastore.continuations(seq.tokens[-c.max_suffix :], budget, min_suffix=c.min_suffix,
                                                 max_suffix=c.max_suffix, max_matches=c.max_matches)
            drafts.append(frequency_tree(found.paths, budget, match_label(found.suffix)))
        return drafts

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        pass

    def memory_bytes(self) -> int:
        return self.datastore.nbytes  # the file size when memory-mapped
