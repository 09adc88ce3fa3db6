"""The proposer interface: where draft tokens come from.

The engine calls, for the rows of a batch (a row is a slot that holds one request at a time):

- ``begin(row, seq)`` when a request enters a row;
- ``propose(seqs, budgets)`` once per step for all rows (``None`` for rows that are idle or
  finished, budget 0 for rows that must not speculate), returning one draft per row with at
  most ``budgets[row]`` nodes;
- ``observe(row, draft, acceptance)`` after verification, so the proposer can roll back its
  own state (a draft model's KV cache), learn, or adapt;
- ``end(row)`` when the request leaves the row.

The sequence's ``tokens`` (prompt + emitted tokens, only ever growing) is the context. A
proposer never touches the target's cache or the engine's state.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol, runtime_checkable

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.sequence import Sequence


@runtime_checkable
class Proposer(Protocol):
    name: str

    def begin(self, row: int, seq: Sequence) -> None: ...

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int]) -> list[Draft]: ...

    def observe(self, row: int, draft: Draft, acceptance: Acceptance) -> None: ...

    def end(self, row: int) -> None: ...

    def memory_bytes(self) -> int: ...


class NoDraft:
    """Plain decoding: never proposes anything."""

    name = "plain"

    def begin(self, row: int, seq: Sequence) -> None:
        pass

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int]) -> list[Draft]:
        return [Draft.empty() for _ in seqs]

    def observe(self, row: int, draft: Draft, acceptance: Acceptance) -> None:
        pass

    def end(self, row: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0
