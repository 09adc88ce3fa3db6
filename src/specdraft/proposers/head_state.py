"""What a proposer drafting from a trained head keeps per row, shared by the feature heads
(EAGLE, MTP) and the early-exit adapter: the head's own keys/values (``HeadCache``), and the
target's tap features of positions the head has not fed yet (``PendingTaps``).

The head's cache holds *exact* entries only up to a row's committed length: entries computed
from the target's own features at committed positions. Drafted entries go to scratch slots
past it and are never committed; the next proposal first feeds the pending exact ones (the
prompt after the prefill, then the root and the accepted nodes of each verification).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.model.transformer import grouped_attention
from specdraft.proposers.base import Features, Verified, move_key


class HeadCache:
    """The head's keys/values per row: [rows, Hkv, capacity, D], grown on demand."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(0, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = self.k.clone()

    def ensure(self, rows: int, capacity: int) -> None:
        r, h, cap, d = self.k.shape
        if rows <= r and capacity <= cap:
            return
        new_rows = r if rows <= r else max(rows, 2 * r)  # grow geometrically, each dimension only when short
        new_cap = cap if capacity <= cap else max(capacity, 2 * cap, 64)
        shape = (new_rows, h, new_cap, d)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(shape)
            new[:r, :, :cap] = old
            setattr(self, name, new)

    def attend(self, rows: Tensor, slots: Tensor, visible: Tensor, group: int):
        """An ``attend`` for ``EagleHead.layer``: writes the new keys/values of row ``rows[i]``
        at ``slots[i]`` ([R, Q]) and lets query j see the keys where ``visible[i, j]`` ([R, Q, S])."""

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [R, Hq, Q, D]; k, v [R, Hkv, Q, D]
            r_idx = rows[:, None].expand_as(slots)  # [R, Q]
            self.k[r_idx, :, slots] = k.transpose(1, 2).to(self.k.dtype)  # [R, Q, Hkv, D]
            self.v[r_idx, :, slots] = v.transpose(1, 2).to(self.v.dtype)
            s = visible.shape[-1]
            keys, values = self.k[rows, :, :s], self.v[rows, :, :s]  # [R, Hkv, S, D]
            mask = visible.repeat(1, group, 1)[:, None]  # [R, 1, G*Q, S]
            return grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, group)

        return run

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` entries to row ``dst`` (``PendingTaps.move``)."""
        if src < self.k.shape[0] and length > 0:
            self.k[dst, :, :length] = self.k[src, :, :length]  # [Hkv, length, D]
            self.v[dst, :, :length] = self.v[src, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2




class PendingTaps:
    """Per row: the head's committed entries (``length``) and the target's features, in
    ``taps`` order, of the positions after them that are not fed yet."""

    def __init__(self, taps: tuple[int, ...]) -> None:
        self.taps = taps
        self.length: dict[int, int] = {}  # row -> committed head entries
        self.pending: dict[int, list[Tensor]] = {}  # row -> [P, taps * H] chunks, in position order
        self.count: dict[int, int] = {}  # row -> entries in its pending chunks (asked every step)

    def begin(self, row: int) -> None:
        self.length[row] = 0
        self.pending[row] = []
        self.count[row] = 0

    def prefilled(self, row: int, features: Features) -> None:
        self._add(row, self._cat(features.taps, slice(None)))

    def observe(self, row: int, acceptance: Acceptance, verified: Verified) -> None:
        """The root's and the accepted nodes' features (verification slots 0 and path + 1)."""
        path = acceptance.path
        if list(path) == list(range(len(path))):  # a chain's accepted prefix: slots 0..n
            self._add(row, self._cat(verified.taps, slice(0, len(path) + 1)).clone())
            return
        slots = torch.tensor([0, *(i + 1 for i in path)], device=verified.hidden.device)
        self._add(row, self._cat(verified.taps, slots))

    def end(self, row: int) -> None:
        self.length.pop(row, None)
        self.pending.pop(row, None)
        self.count.pop(row, None)

    def move(self, src: int, dst: int, cache: HeadCache) -> None:
        """The row's request moved from ``src`` to ``dst``: its state and head entries follow."""
        cache.move_row(src, dst, self.length.get(src, 0))
        move_key(self.length, src, dst)
        move_key(self.pending, src, dst)
        move_key(self.count, src, dst)

    def backlog(self, row: int) -> int:
        """Entries pending for the row (the next proposal feeds them)."""
        return self.count.get(row, 0)

    def ready(self, row: int) -> bool:
        """Whether the row has an anchor to draft from (something pending)."""
        return bool(self.pending.get(row))

    def take(self, rows: list[int]) -> tuple[list[Tensor], list[int]]:
        """Each row's pending features [P_r, taps * H] and the slot they start at; from now on
        they count as committed (the caller feeds them)."""
        feats = [torch.cat(self.pending[r]) for r in rows]
        starts = [self.length[r] for r in rows]
        for r, f in zip(rows, feats):
            self.length[r] += len(f)
            self.pending[r] = []
            self.count[r] = 0
        return feats, starts

    def put_back(self, row: int, feats: Tensor) -> None:
        """Return the last ``len(feats)`` of the entries just taken to pending (uncommitted)."""
        self.length[row] -= len(feats)
        self.pending[row] = [feats]
        self.count[row] = len(feats)

    def _add(self, row: int, feats: Tensor) -> None:  # feats: [P, taps * H]
        self.pending[row].append(feats)
        self.count[row] += len(feats)

    def _cat(self, taps: dict[int, Tensor], index: slice | Tensor) -> Tensor:
        if len(self.taps) == 1:
            return taps[self.taps[0]][index]  # [P, H]
        return torch.cat([taps[t][index] for t in self.taps], dim=-1)  # [P, taps * H]
