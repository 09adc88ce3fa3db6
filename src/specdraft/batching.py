"""How prompts are fed: one chunked, ragged prefill shared by the scheduler (a joining prompt,
one chunk at a time) and the draft model's catch-up (each row's backlog after its cached
positions), with chunk sizes and groups of similar length.

Rows are right-padded to the longest one in a chunk; each row's tokens go after its own cached
positions, and the cache then keeps only its real ones. ``hidden[r]`` gets the final hidden
state after row r's last token (``done[r]`` says it did), and ``parts`` (where given) each
chunk's final-norm states (key -1) and the asked-for layer taps per row.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from specdraft.model.kv_cache import KVCache
from specdraft.model.transformer import Transformer

PREFILL_CHUNK = 512  # prompt tokens per forward during prefill (bounds the attention scores' memory)
PREFILL_TOKENS = 8192  # padded prompt tokens (rows x longest prompt) prefilled together

Parts = list[dict[int, list[Tensor]]]  # per row: feature key -> the chunks' states [n, H]


def prefill_groups(lengths: list[int], budget: int = PREFILL_TOKENS, chunk: int | None = None) -> list[list[int]]:
    """Rows prefilled together, longest prompts first: a group takes rows while its size times
    its longest prompt (with ``chunk``: its widest chunk, min(longest, chunk)) stays within
    ``budget`` (at least one row). Rows of similar length end up together, so padding stays
    small; a batch of short prompts stays one group."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups: list[list[int]] = []
    for r in order:
        width = max(1, lengths[groups[-1][0]]) if groups else 1
        if chunk is not None:
            width = min(width, chunk)
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def feed_chunk(model: Transformer, rows: Seq[Seq[int]], start: int, width: int, cache: KVCache, hidden: Tensor,
               done: list[bool], taps: Seq[int] = (), parts: Parts | None = None) -> None:
    """Feed tokens start..start+width of every row's ``rows[r]`` (module doc). hidden: [B, H]."""
    device = model.device
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [B, width]
    for r, t in enumerate(rows):
        part = t[start : start + width]
        if part:
            tokens[r, : len(part)] = torch.as_tensor(part, dtype=torch.long)
    real = [max(0, min(len(t), start + width) - start) for t in rows]  # each row's tokens here
    before = list(cache.lengths)
    positions = torch.tensor(before, device=device)[:, None] + torch.arange(width, device=device)  # [B, width]
    out = model(tokens.to(device), positions, cache, logits=False, prompt=real,
                return_hidden=tuple(taps) if parts is not None else ())
    for r, t in enumerate(rows):
        if start < len(t) <= start + width:
            hidden[r] = out.last_hidden[r, len(t) - 1 - start]
            done[r] = True
        if parts is not None and real[r]:
            for key, states in ((-1, out.last_hidden), *out.hidden.items()):
                parts[r].setdefault(key, []).append(states[r, : real[r]])  # [real, H]
    cache.truncate([n + k for n, k in zip(before, real)])


def feed(model: Transformer, rows: Seq[Seq[int]], cache: KVCache, chunk: int, hidden: Tensor, done: list[bool],
         taps: Seq[int] = (), parts: Parts | None = None) -> None:
    """Feed every row's ``rows[r]`` in chunks of up to ``chunk`` tokens, while the cache has room."""
    start = 0
    while any(len(t) > start for t in rows):
        width = min(chunk, max(len(t) for t in rows) - start, cache.capacity - max(cache.lengths))
        if width < 1:
            break
        feed_chunk(model, rows, start, width, cache, hidden, done, taps, parts)
        start += width


def feed_group(model: Transformer, rows: Seq[Seq[int]], group: list[int], cache: KVCache, chunk: int, hidden: Tensor,
               done: list[bool], taps: Seq[int] = (), parts: Parts | None = None) -> None:
    """Feed the rows of ``group`` (indices into ``rows``) in a cache of their own, sized for
    them, then copy it into theirs: the other rows neither compute their length nor hold
    attention scores for it."""
    part = model.new_cache(len(group), min(cache.capacity, max(len(rows[r]) for r in group)))
    part_hidden = torch.zeros(len(group), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)  # [G, H]
    part_done = [False] * len(group)
    feed(model, [rows[r] for r in group], part, chunk, part_hidden, part_done, taps,
         None if parts is None else [parts[r] for r in group])
    cache.copy_rows(part, group)
    hidden[group] = part_hidden
    for r, ok in zip(group, part_done):
        done[r] = ok


def prefill(model: Transformer, prompts: Seq[Seq[int]], cache: KVCache, chunk: int = PREFILL_CHUNK,
            budget: int = PREFILL_TOKENS, taps: Seq[int] = (), parts: Parts | None = None) -> Tensor:
    """Feed whole prompts into empty rows, in groups of similar length (``prefill_groups``; a
    group other than the whole batch in a cache of its own). Returns the final hidden state
    after each prompt's last token: [B, H]."""
    hidden = torch.zeros(len(prompts), model.config.hidden_size, dtype=model.dtype, device=model.device)  # [B, H]
    done = [False] * len(prompts)
    groups = prefill_groups([len(p) for p in prompts], budget)
    if len(groups) == 1:
        feed(model, prompts, cache, chunk, hidden, done, taps, parts)
    else:
        for group in groups:
            feed_group(model, prompts, group, cache, chunk, hidden, done, taps, parts)
    return hidden
