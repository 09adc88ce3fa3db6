"""The proposer interface: where draft tokens come from.

The engine calls, for the rows of a batch (a row is a slot that holds one request at a time):

- ``begin(row, seq)`` when a request enters a row;
- ``propose(seqs, budgets, cache)`` once per step for all rows (``None`` for rows that are
  idle or finished, budget 0 for rows that must not speculate), returning one draft per row
  with at most ``budgets[row]`` nodes;
- ``observe(row, draft, acceptance, verified)`` after verification, with the target's
  logits and final hidden states at the root and every draft node, so the proposer can roll
  back its own state (a draft model's KV cache), learn, or adapt;
- ``end(row)`` when the request leaves the row;
- ``move(src, dst)`` (optional) between steps, when the scheduler packs a running request from
  row ``src`` into the free row ``dst`` (the target's cache row has moved with it): the
  proposer's per-row state follows. Without it, the scheduler never moves that proposer's rows.

A proposer that learns across requests (suffix decoding's trie of earlier outputs) may also
implement ``snapshot()`` and ``restore(snapshot)``, so that a benchmark's repeated runs of
the same prompts each start from the same memory instead of drafting from their own
earlier outputs.

A proposer that must catch up on a request's context before it can draft (a draft model's
own prefill) may implement ``setup_seconds(seqs) -> list[float]``: the estimated time per row
(``None`` rows: 0). The adaptive policy then pays it only where it is repaid (``policy.py``).
Such a proposer sets ``setup_spent`` at each ``propose`` to the seconds it spent catching up
in it, which the engine leaves out of the drafting time it reports to the policy (a prompt's
catch-up is not what each later draft costs).

A proposer whose budget counts a tree's nodes rather than its depth (EAGLE's dynamic trees, a
Medusa tree) sets ``trees = True``. The engine then caps a row's budget by the cache's room
alone, not by the tokens the row may still emit: only a path's depth is bounded by those, so a
row near its end keeps a full tree of shallower nodes. Such a proposer should not draft deeper
than ``seq.room - 1`` (the engine drops deeper nodes, which could never be emitted).

The sequence's ``tokens`` (prompt + emitted tokens, only ever growing) is the context.

The target's cache is lent to ``propose``: row ``r`` holds the keys/values of
``seq.tokens[:cache.lengths[r]]`` (every token but the last, which the verifier feeds as the
draft's root). A proposer may *read* the committed positions (self-speculation runs the
target's first layers on them) and may use the positions past ``lengths`` as scratch, but must
leave ``lengths`` as it found them: the verifier overwrites the scratch. It never touches the
engine's state otherwise.

A proposer that needs the target model (self-speculation, heads) or its tokenizer (a draft
model's vocabulary check) gets them from the ``ProposerContext`` its factory receives.

A proposer that drafts from the target's features (EAGLE, Medusa, MTP heads) declares what it
needs with a ``features`` attribute (a ``FeatureRequest``): layer taps, returned in ``Verified``
at every verification slot, and, with ``prompt``, the features of every prompt position, handed
once to ``prefilled(row, features)`` after the prefill (so a head can fill its own cache).
Proposers that ask for nothing cost nothing: the forwards then return no taps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol, runtime_checkable

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.model.kv_cache import KVCache
from specdraft.sequence import Sequence

if TYPE_CHECKING:
    from specdraft.model.tokenizer import Tokenizer
    from specdraft.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer factory may use of the target: the model, its tokenizer, the largest
    draft the policy will ask for, and the model's file or folder (for the heads the package
    ships for it; empty: unknown)."""

    target: "Transformer"
    tokenizer: "Tokenizer"
    max_draft: int = 8
    source: str = ""


@dataclass(frozen=True, slots=True)
class FeatureRequest:
    """What of the target's hidden states a proposer needs. taps: layer outputs (0 = the
    embeddings, i = the output of layer i, num_layers = the last layer before the final norm);
    prompt: also the features of every prompt position, once, after the prefill."""

    taps: tuple[int, ...] = ()
    prompt: bool = False

    @property
    def any(self) -> bool:
        return bool(self.taps) or self.prompt


NO_FEATURES = FeatureRequest()


@dataclass(frozen=True, slots=True)
class Features:
    """The target's hidden states over a run of one row's tokens."""

    last_hidden: Tensor  # [T, H] after the final norm (the LM head's input)
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer i -> [T, H], as requested


@dataclass(frozen=True, slots=True)
class Verified:
    """The target's view of one row's draft, from the verification pass."""

    logits: Tensor  # [1 + W, V] float32: at the root (row 0) and draft node i (row i + 1); W >= N
    hidden: Tensor  # [1 + W, H] final-norm hidden states at the same slots
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer i -> [1 + W, H] (the proposer's FeatureRequest)


def feature_request(proposer: object) -> FeatureRequest:
    """The proposer's ``features`` (optional: none when absent)."""
    request = getattr(proposer, "features", NO_FEATURES)
    if not isinstance(request, FeatureRequest):
        raise TypeError(f"proposer {getattr(proposer, 'name', proposer)!r}: features must be a FeatureRequest")
    return request


@runtime_checkable
class Proposer(Protocol):
    name: str

    def begin(self, row: int, seq: Sequence) -> None: ...

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]: ...

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None: ...

    def end(self, row: int) -> None: ...

    def memory_bytes(self) -> int: ...


class NoDraft:
    """Plain decoding: never proposes anything."""

    name = "plain"

    def begin(self, row: int, seq: Sequence) -> None:
        pass

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        return [Draft.empty() for _ in seqs]

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        pass

    def end(self, row: int) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0


def move_key(table: dict, src: int, dst: int) -> None:
    """``table[src]`` becomes ``table[dst]`` (a row's state follows its request; ``move``)."""
    if src in table:
        table[dst] = table.pop(src)
    else:
        table.pop(dst, None)
