"""How a batch's prompts are fed: chunk sizes and groups of similar length, shared by the
engine's prefill and the draft model's first catch-up."""

from __future__ import annotations

PREFILL_CHUNK = 512  # prompt tokens per forward during prefill (bounds the attention scores' memory)
PREFILL_TOKENS = 8192  # padded prompt tokens (rows x longest prompt) prefilled together


def prefill_groups(lengths: list[int], budget: int = PREFILL_TOKENS) -> list[list[int]]:
    """Rows prefilled together, longest prompts first: a group takes rows while its size times
    its longest prompt stays within ``budget`` (at least one row). Rows of similar length end up
    together, so padding stays small; a batch of short prompts stays one group."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups: list[list[int]] = []
    for r in order:
        if groups and (len(groups[-1]) + 1) * max(1, lengths[groups[-1][0]]) <= budget:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups
