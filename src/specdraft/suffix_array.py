"""A suffix array over token ids: "every position where this token sequence occurs".

``suffix_array(tokens)`` sorts the suffixes of a token array by prefix doubling (Manber &
Myers): after round r every suffix is ranked by its first 2^r tokens, each round one sort of
(rank, rank 2^r further on) pairs, until all ranks differ. That is O(n log n) per round and
O(log L) rounds, L the longest repeated substring.

Order: tokens compare as integers; a suffix that ends (runs past the array) sorts before
every longer one with the same start. Python list comparison agrees with this, so the
searches below compare ``tokens[p : p + m].tolist()`` with the pattern.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` [n] in sorted order: [n] int32 (int64 when
    n does not fit int32)."""
    n = int(tokens.shape[0])
    index_type = np.int32 if n < 2**31 else np.int64
    if n == 0:
        return np.zeros(0, dtype=index_type)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(n)  # [n] dense ranks
    order = np.argsort(rank, kind="stable")  # [n]
    span = 1
    while int(rank[order[-1]]) < n - 1 and span < n:  # some ranks still tied
        rank, order = _double(rank, span)
        span *= 2
    return order.astype(index_type)


def _double(rank: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranks by the first 2 * span tokens, from ranks by the first span tokens. [n] -> [n], [n]."""
    n = rank.shape[0]
    second = np.zeros(n, dtype=np.int64)  # [n] 0 = past the end, below every token
    second[: n - span] = rank[span:] + 1
    key = rank * (n + 1) + second  # [n] < n^2 + n, fits int64 for any array we can hold
    order = np.argsort(key, kind="stable")  # [n]
    ordered = key[order]  # [n]
    new_rank = np.empty(n, dtype=np.int64)
    new_rank[order] = np.concatenate(([0], np.cumsum(ordered[1:] != ordered[:-1])))
    return new_rank, order


def find_range(
    tokens: np.ndarray, sa: np.ndarray, pattern: Sequence[int], lo: int = 0, hi: int | None = None
) -> tuple[int, int]:
    """The slice [lo, hi) of ``sa`` whose suffixes start with ``pattern`` (lo == hi: none),
    searched within sa[lo:hi]."""
    hi = sa.shape[0] if hi is None else hi
    lo = _lower(tokens, sa, pattern, lo, hi)
    if lo >= hi or not _starts_with(tokens, sa, lo, pattern):
        return lo, lo
    return lo, _upper(tokens, sa, pattern, lo, hi)


def longest_match(
    tokens: np.ndarray, sa: np.ndarray, context: Sequence[int], min_len: int, max_len: int
) -> tuple[int, int, int]:
    """The longest suffix of ``context`` (min_len..max_len tokens) that occurs in ``tokens``:
    (its length, lo, hi) with sa[lo:hi] its occurrences; (0, 0, 0) when none does.

    Occurring is monotone in the length (a suffix of an occurrence occurs), so the length is
    found by binary search: about log2(max_len) searches instead of one per length."""
    best = (0, 0, 0)
    low, high = min_len, min(max_len, len(context))
    while low <= high:
        m = (low + high) // 2
        pattern = list(context[len(context) - m :])
        lo = _lower(tokens, sa, pattern)
        if _starts_with(tokens, sa, lo, pattern):
            best = (m, lo, _upper(tokens, sa, pattern, lo))
            low = m + 1
        else:
            high = m - 1
    return best


def _prefix_key(tokens: np.ndarray, m: int) -> Callable[[int], list[int]]:
    """Position -> its first m tokens, as a list (the bisect key)."""
    return lambda p: tokens[int(p) : int(p) + m].tolist()


def _lower(tokens: np.ndarray, sa: np.ndarray, pattern: Sequence[int], lo: int = 0, hi: int | None = None) -> int:
    hi = sa.shape[0] if hi is None else hi
    return bisect.bisect_left(sa, list(pattern), lo=lo, hi=hi, key=_prefix_key(tokens, len(pattern)))


def _upper(tokens: np.ndarray, sa: np.ndarray, pattern: Sequence[int], lo: int, hi: int | None = None) -> int:
    hi = sa.shape[0] if hi is None else hi
    return bisect.bisect_right(sa, list(pattern), lo=lo, hi=hi, key=_prefix_key(tokens, len(pattern)))


def _starts_with(tokens: np.ndarray, sa: np.ndarray, i: int, pattern: Sequence[int]) -> bool:
    if i >= sa.shape[0]:
        return False
    p = int(sa[i])
    return tokens[p : p + len(pattern)].tolist() == list(pattern)
