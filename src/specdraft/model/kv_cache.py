"""A static, preallocated key/value cache with one committed length per row.

Every forward pass *appends* its T new positions to every row, right after that row's
committed length. What happens next is the caller's choice:

- ``truncate(lengths)``: roll back (drop rejected draft tokens, or a ragged batch's padding);
- ``commit(start, keep, n_keep)``: keep a chosen subset of the appended positions (an
  accepted tree path), compacted into the prefix with one gather per layer.

Rolling back is a length change; nothing is freed or zeroed. Entries past a row's length
are garbage and never attended to (the model masks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.errors import ContextOverflowError
from specdraft.model.config import ModelConfig


@dataclass(slots=True)
class KVCache:
    k: Tensor  # [L, B, Hkv, S, D]
    v: Tensor  # [L, B, Hkv, S, D]
    lengths: list[int]  # committed length of each row (host-side: no device sync to read it)

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
    ) -> "KVCache":
        layers = config.num_layers if num_layers is None else num_layers
        shape = (layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=[0] * batch_size,
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def lengths_tensor(self) -> Tensor:  # [B] int64 on the cache device
        return torch.tensor(self.lengths, dtype=torch.long, device=self.k.device)

    def check_room(self, new_tokens: int) -> None:
        """Raise if appending ``new_tokens`` to some row would overflow the capacity."""
        longest = max(self.lengths) + new_tokens
        if longest > self.capacity:
            raise ContextOverflowError(
                f"KV cache overflow: a row would reach {longest} positions, capacity is {self.capacity}"
            )

    def write(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new keys/values of ``layer`` after each row's committed length and return
        the keys/values of all positions that any row can attend to in this pass.

        k_new, v_new: [B, Hkv, T, D]. Returns k, v: [B, Hkv, max(lengths) + T, D].
        """
        t = k_new.shape[2]
        lo, hi = min(self.lengths), max(self.lengths)
        if lo == hi:  # every row at the same length: a plain slice
            self.k[layer, :, :, lo : lo + t] = k_new
            self.v[layer, :, :, lo : lo + t] = v_new
        else:
            rows = torch.arange(self.batch_size, device=self.k.device)[:, None]  # [B, 1]
            cols = self.lengths_tensor()[:, None] + torch.arange(t, device=self.k.device)  # [B, T]
            self.k[layer, rows, :, cols] = k_new.transpose(1, 2)  # [B, T, Hkv, D]
            self.v[layer, rows, :, cols] = v_new.transpose(1, 2)
        return self.k[layer, :, :, : hi + t], self.v[layer, :, :, : hi + t]

    def advance(self, new_tokens: int) -> None:
        """Count the positions just written by a forward pass as part of every row."""
        self.lengths = [n + new_tokens for n in self.lengths]

    def truncate(self, lengths: list[int] | int) -> None:
        """Roll rows back to the given lengths (an int applies to every row)."""
        new = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(new) != self.batch_size:
            raise ValueError(f"truncate: {len(new)} lengths for {self.batch_size} rows")
        for old, n in zip(self.lengths, new):
            if not 0 <= n <= max(old, 0):
                raise ValueError(f"truncate: cannot move a row of length {old} to {n}")
        self.lengths = new

    def truncate_row(self, row: int, length: int) -> None:
        """Roll one row back to ``length`` (``truncate`` for one row, without touching the others)."""
        old = self.lengths[row]
        if not 0 <= length <= max(old, 0):
            raise ValueError(f"truncate: cannot move a row of length {old} to {length}")
        self.lengths[row] = length

    def commit(self, start: list[int], keep: Tensor, n_keep: list[int]) -> None:
        """Compact chosen appended positions into each row's prefix.

        start:  committed length of each row before the pass that appended the positions.
        keep:   [B, K] int64, indices relative to ``start`` of the positions to keep, in order;
                entries past ``n_keep[b]`` are ignored (pad with anything in range).
        n_keep: how many positions each row keeps.
        After the call row b has length ``start[b] + n_keep[b]`` and position ``start[b] + i``
        holds what was at ``start[b] + keep[b, i]``.
        """
        b, k = keep.shape
        if k == 0:
            self.truncate(list(start))
            return
        base = torch.tensor(start, dtype=torch.long, device=self.k.device)[:, None]  # [B, 1]
        src = base + keep.to(self.k.device)  # [B, K]
        dst = base + torch.arange(k, device=self.k.device)  # [B, K]
        rows = torch.arange(b, device=self.k.device)[:, None]  # [B, 1]
        for cache in (self.k, self.v):
            gathered = cache[:, rows, :, src]  # [B, K, L, Hkv, D]
            cache[:, rows, :, dst] = gathered
        self.lengths = [s + n for s, n in zip(start, n_keep)]

    def copy_rows(self, source: "KVCache", rows: list[int], source_rows: list[int] | None = None) -> None:
        """Copy each row ``source_rows[j]`` of ``source`` (its committed positions; default: every
        row, in order) into row ``rows[j]`` here, which then has that length; used to prefill a
        few rows in a smaller cache."""
        picked = list(range(source.batch_size)) if source_rows is None else source_rows
        if len(rows) != len(picked):
            raise ValueError(f"copy_rows: {len(rows)} target rows for {len(picked)} source rows")
        for i, row in zip(picked, rows):
            n = source.lengths[i]
            if n > self.capacity:
                raise ContextOverflowError(f"copy_rows: a row of {n} positions does not fit a capacity of {self.capacity}")
            self.k[:, row, :, :n] = source.k[:, i, :, :n]  # [L, Hkv, n, D]
            self.v[:, row, :, :n] = source.v[:, i, :, :n]
            self.lengths[row] = n

    def head(self, rows: int) -> "KVCache":
        """The first ``rows`` rows as a cache of their own that shares this one's storage (a
        continuous batch runs only up to its last occupied slot). Its ``lengths`` is a copy:
        hand it back with ``self.lengths[:rows] = view.lengths``."""
        if not 0 < rows <= self.batch_size:
            raise ValueError(f"head: {rows} rows of a cache of {self.batch_size}")
        return KVCache(self.k[:, :rows], self.v[:, :rows], self.lengths[:rows])

    def move_row(self, src: int, dst: int) -> None:
        """Move row ``src``'s committed positions into the free row ``dst`` and free ``src``
        (the scheduler packs running requests into the lowest slots)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]  # [L, Hkv, n, D]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def reset_row(self, row: int) -> None:
        """Free one row for a new request (continuous batching)."""
        self.lengths[row] = 0
