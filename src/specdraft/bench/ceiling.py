"""The copy ceiling: how far any proposer that copies spans of the request's own context
(n-gram lookup, suffix decoding of the request) could get on a given output.

An oracle that knows the output drafts, at each step, the longest next span (at most k tokens)
that occurs somewhere in the context so far (prompt + output before it); the target accepts
all of it and adds its bonus token. Its tau is an upper bound for context-copying methods with
drafts of at most k tokens (retrieval from a datastore or a draft model can beat it): a
workload whose ceiling is 1.3 cannot reach tau 2.5 by copying.
"""

from __future__ import annotations

from collections.abc import Sequence


def _encode(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def copy_ceiling_steps(prompt: Sequence[int], output: Sequence[int], k: int) -> int:
    """Target passes the oracle needs for ``output`` (the first token comes from the prefill
    and is not counted, as in SpecStats)."""
    context = bytearray(_encode(list(prompt) + list(output[:1])))
    i, steps = 1, 0
    while i < len(output):
        span = _longest_copy(context, output, i, k)
        accepted = min(span, len(output) - 1 - i)
        steps += 1
        context += _encode(output[i : i + accepted + 1])
        i += accepted + 1
    return steps


def _longest_copy(context: bytearray, output: Sequence[int], i: int, k: int) -> int:
    """Longest L <= k such that output[i : i + L] occurs token-aligned in ``context``."""
    best = 0
    for length in range(1, k + 1):
        if i + length > len(output):
            break
        needle = _encode(output[i : i + length])
        if not _aligned_find(context, needle):
            break
        best = length
    return best


def _aligned_find(haystack: bytearray, needle: bytes) -> bool:
    start = haystack.find(needle)
    while start != -1:
        if start % 4 == 0:
            return True
        start = haystack.find(needle, start + 1)
    return False


def copy_ceiling_tau(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], k: int) -> float:
    """Emitted tokens per target pass of the oracle over (prompt, output) pairs."""
    emitted = sum(max(len(o) - 1, 0) for _, o in pairs)
    steps = sum(copy_ceiling_steps(p, o, k) for p, o in pairs)
    return emitted / steps if steps else 1.0
