"""The copy ceiling: how far any proposer that copies spans of the request's own context
(n-gram lookup, suffix decoding of the request) could get on a given output.

An oracle that knows the output drafts, at each step, the longest next span (at most k tokens)
that occurs somewhere in the context so far (prompt + output before it); the target accepts
all of it and adds its bonus token. Its tau is an upper bound for context-copying methods with
drafts of at most k tokens (retrieval from a datastore or a draft model can beat it): a
workload whose ceiling is 1.3 cannot reach tau 2.5 by copying.

The lookup ceiling is the tighter bound for proposers that *find* what to copy by matching the
end of the context (n-gram / prompt lookup, suffix trees of the request, a lookahead pool built
from it): every such draft continues some earlier occurrence of at least the last token. Its
oracle tries the continuation of every earlier occurrence of the last token (so of every longer
suffix too) and keeps the one that matches the output longest: a tree of unlimited width with
a perfect choice. The copy ceiling also counts spans that no suffix of the context points to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _encode(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def copy_ceiling_steps(prompt: Sequence[int], output: Sequence[int], k: int) -> int:
    """Target passes the oracle needs for ``output`` (the first token comes from the prefill
    and is not counted, as in SpecStats)."""
    return len(copy_oracle_spans(prompt, output, k))


def copy_oracle_spans(prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
    """The draft tokens the copy oracle gets accepted at each target pass (a bonus follows each)."""
    context = bytearray(_encode(list(prompt) + list(output[:1])))
    i, spans = 1, []
    while i < len(output):
        accepted = min(_longest_copy(context, output, i, k), len(output) - 1 - i)
        spans.append(accepted)
        context += _encode(output[i : i + accepted + 1])
        i += accepted + 1
    return spans


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


def lookup_ceiling_steps(prompt: Sequence[int], output: Sequence[int], k: int) -> int:
    """Target passes the lookup oracle needs for ``output`` (first token from the prefill)."""
    return len(lookup_oracle_spans(prompt, output, k))


def lookup_oracle_spans(prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
    """The draft tokens the lookup oracle gets accepted at each target pass."""
    context = [int(t) for t in prompt] + [int(t) for t in output[:1]]
    seen: dict[int, list[int]] = {}  # token -> positions j whose token follows an occurrence of it
    for j in range(1, len(context)):
        seen.setdefault(context[j - 1], []).append(j)
    i, spans = 1, []
    while i < len(output):
        want = output[i : min(i + k, len(output) - 1)]  # what an accepted draft would spell
        best = 0
        for j in seen.get(context[-1], ()):
            n = 0
            while n < len(want) and j + n < len(context) and context[j + n] == want[n]:
                n += 1
            best = max(best, n)
        spans.append(best)
        for token in output[i : i + best + 1]:
            seen.setdefault(context[-1], []).append(len(context))
            context.append(int(token))
        i += best + 1
    return spans


Pairs = Sequence[tuple[Sequence[int], Sequence[int]]]


def copy_ceiling_tau(pairs: Pairs, k: int) -> float:
    """Emitted tokens per target pass of the copy oracle over (prompt, output) pairs."""
    return _tau(pairs, k, copy_ceiling_steps)


def lookup_ceiling_tau(pairs: Pairs, k: int) -> float:
    """Emitted tokens per target pass of the lookup oracle over (prompt, output) pairs."""
    return _tau(pairs, k, lookup_ceiling_steps)


def _tau(pairs: Pairs, k: int, steps_of: Callable[[Sequence[int], Sequence[int], int], int]) -> float:
    emitted = sum(max(len(o) - 1, 0) for _, o in pairs)
    steps = sum(steps_of(p, o, k) for p, o in pairs)
    return emitted / steps if steps else 1.0
