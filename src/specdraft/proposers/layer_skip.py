"""Self-speculation by early exit: the target's first L layers (then its final norm and LM
head) draft the tokens; optionally its last few layers too, skipping only a middle block
(``last``). No extra weights and no extra cache.

The target's cache, lent to ``propose``, already holds every row's committed prefix for all
layers, so the first L of them are exactly the draft's context. Each level feeds one token per
row (the root first, at position ``cache.lengths[row]``, then each drafted token) through the
first L layers, writing only scratch positions past the committed lengths, which are restored
before returning (the verifier overwrites the scratch). With ``last`` > 0 the last layers
attend to the target's own keys and values of the committed prefix, as skip-the-middle
self-speculation does (Draft & Verify, SWIFT): only the drafted positions see the skip. Chain
drafting, greedy and sampled, is shared with the draft-model proposer (:mod:`.autoregressive`).

With a trained adapter (Kangaroo, :mod:`specdraft.heads.adapter`) the early exit reads layer
L's state through one attention layer and a norm of its own before the target's LM head. The
adapter keeps its own keys/values per row: exact entries from the target's layer-L features
at committed positions (asked for as a tap and fed at the next proposal, as the feature heads
do), scratch entries for the drafted positions. An adapter sets L (its exit layer). Where it
carries a reduced draft vocabulary, drafts read only those rows of the target's LM head.

The default L comes from a measurement on SmolLM2-135M (30 layers): see
``results/layer-skip`` and ``docs/methods/layer-skip.md``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.model.transformer import Transformer
from specdraft.heads.adapter import ExitAdapter, load_adapter
from specdraft.heads.shipped import shipped_heads
from specdraft.heads.vocab import ReducedHead
from specdraft.proposers.autoregressive import Drafter, StepDrafter, draft_chains
from specdraft.proposers.base import NO_FEATURES, FeatureRequest, Features, ProposerContext, Verified
from specdraft.proposers.head_state import HeadCache, PendingTaps
from specdraft.sequence import Sequence

DEFAULT_LAYERS = 4  # chosen by the sweep in results/layer-skip (see the module doc)


@dataclass(frozen=True, slots=True)
class LayerSkipConfig:
    """layers: how many of the target's first layers draft (1..num_layers-1; fewer = cheaper
    drafts that are accepted less often). last: also run the target's last ``last`` layers,
    skipping the block in between (0 = early exit; layers + last <= num_layers - 1).
    branches: candidates at the first draft position (1 = a chain; b > 1 = a tree whose first
    candidate continues as the chain). adapter: a trained early-exit adapter (``specdraft train
    layer-skip``; empty: the one shipped for the model if any; ``none``: the untrained exit); it
    sets ``layers`` to its exit layer. full_vocab: draft over the whole vocabulary even where the
    adapter has a reduced draft vocabulary (slower drafts; for comparison). stop_below:
    Kangaroo's confidence stop, a chain ends where the exit's top probability for the next token
    falls below it (0 = draft the whole budget). distinct: a sampled row's first-position
    candidates are drawn without replacement (False: independent draws, which may repeat)."""

    layers: int = DEFAULT_LAYERS
    branches: int = 1
    last: int = 0
    adapter: str = ""  # a trained adapter folder; "" = the one shipped for the model, if any; "none" = untrained
    full_vocab: bool = False
    stop_below: float = 0.0
    distinct: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.stop_below, (int, float)) or not 0.0 <= self.stop_below < 1.0:
            raise SpecdraftError(f"layer-skip: stop_below must be in [0, 1), got {self.stop_below!r}")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise SpecdraftError(f"layer-skip: layers must be an integer >= 1, got {self.layers!r}")
        if not isinstance(self.last, int) or self.last < 0:
            raise SpecdraftError(f"layer-skip: last must be an integer >= 0, got {self.last!r}")
        if not isinstance(self.branches, int) or not 1 <= self.branches <= 16:
            raise SpecdraftError(f"layer-skip: branches must be in 1..16, got {self.branches!r}")


class LayerSkipProposer:
    name = "layer-skip"

    def __init__(self, target: Transformer, layers: int, branches: int = 1, last: int = 0,
                 adapter: ExitAdapter | None = None, full_vocab: bool = False, stop_below: float = 0.0,
                 distinct: bool = True) -> None:
        total = target.config.num_layers
        if adapter is not None and (last or adapter.config.exit_layer != layers):
            raise SpecdraftError(f"layer-skip: the adapter exits after layer {adapter.config.exit_layer}; "
                                 f"got layers={layers}, last={last}")
        if not 1 <= layers < total:
            raise SpecdraftError(f"layer-skip: layers must be in 1..{total - 1} for this {total}-layer model, got {layers}")
        if layers + last >= total:
            raise SpecdraftError(f"layer-skip: layers + last must be at most {total - 1} for this {total}-layer model "
                                 f"(at least one layer skipped), got {layers} + {last}")
        self.target = target
        self.layers = layers
        self.branches = branches
        self.stop_below = float(stop_below)
        self.distinct = distinct
        self.layer_ids = (*range(layers), *range(total - last, total))  # the layers that draft
        self.adapter = None if adapter is None else adapter.to(device=target.device, dtype=target.dtype).eval()
        vocab = None if adapter is None or full_vocab else adapter.vocab
        self.head = None if vocab is None else ReducedHead(target.lm_head.weight, vocab)  # (None: the full LM head)
        self.features = NO_FEATURES if adapter is None else FeatureRequest(taps=(layers,), prompt=True)
        self.rows = PendingTaps((layers,))
        c = target.config
        self.cache = HeadCache(c.num_kv_heads, c.head_dim, target.dtype, target.device)

    def begin(self, row: int, seq: Sequence) -> None:
        self.rows.begin(row)

    @torch.inference_mode()
    def prefilled(self, row: int, features: Features) -> None:
        """Feed the prompt's layer-L entries now, in the prefill (so that the first proposal
        costs what any other does, which is what the adaptive policy prices drafting by)."""
        self.rows.prefilled(row, features)
        if self.adapter is not None:
            self._feed([row])

    def end(self, row: int) -> None:
        self.rows.end(row)

    def move(self, src: int, dst: int) -> None:
        self.rows.move(src, dst, self.cache)  # without an adapter it drafts from the target's cache, which moved

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        if not any(s is not None and b > 0 for s, b in zip(seqs, budgets)):
            return [Draft.empty() for _ in seqs]
        committed = list(cache.lengths)
        drafter: StepDrafter = Drafter(self.target, cache, layers=self.layer_ids)
        if self.adapter is not None:
            drafter = self._adapted(seqs, budgets, cache)
        try:
            root_logits = drafter.step([s.tokens[-1] if s is not None else 0 for s in seqs])  # [B, V]
            vocab = self.target.config.vocab_size
            return draft_chains(drafter, root_logits, seqs, budgets, self.branches, vocab, self.stop_below,
                                self.distinct).drafts
        finally:
            cache.truncate(committed)

    def _adapted(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> "_AdaptedDrafter":
        """Feed the drafting rows' pending exact entries to the adapter; a drafter over it."""
        assert self.adapter is not None
        rows = [r for r, (s, b) in enumerate(zip(seqs, budgets)) if s is not None and b > 0 and self.rows.ready(r)]
        pending = max((sum(len(p) for p in self.rows.pending.get(r, [])) for r in rows), default=0)
        lengths = [self.rows.length.get(r, 0) for r in range(len(seqs))]
        self.cache.ensure(len(seqs), max(lengths) + pending + max(budgets) + 2)
        if rows:
            self._feed(rows)
        base = torch.tensor([self.rows.length.get(r, 0) for r in range(len(seqs))], device=self.target.device)
        return _AdaptedDrafter(self, cache, base)

    def _feed(self, rows: list[int]) -> None:
        """Feed these rows' pending layer-L features to the adapter's cache."""
        assert self.adapter is not None
        width = max(self.rows.backlog(r) for r in rows)
        self.cache.ensure(max(rows) + 1, max(self.rows.length[r] for r in rows) + width + 1)
        if width:
            feats, starts = self.rows.take(rows)
            width = max(len(f) for f in feats)
            dev = self.target.device
            h = torch.zeros(len(rows), width, feats[0].shape[-1], dtype=self.target.dtype, device=dev)  # [R, P, H]
            for i, f in enumerate(feats):
                h[i, : len(f)] = f
            slots = torch.tensor(starts, device=dev)[:, None] + torch.arange(width, device=dev)  # [R, P]
            visible = torch.arange(int(slots.max()) + 1, device=dev)[None, None, :] <= slots[:, :, None]  # [R, P, S]
            last = torch.tensor([s + len(f) - 1 for s, f in zip(starts, feats)], device=dev)
            positions = torch.minimum(slots, last[:, None])  # padding: the row's last real position
            _adapter_step(self.adapter, self.target, self.cache, rows, h, positions, slots, visible)

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        if self.adapter is not None:
            self.rows.observe(row, acceptance, verified)  # the target's cache is the engine's: nothing to roll back

    def memory_bytes(self) -> int:
        if self.adapter is None:
            return 0
        head = 0 if self.head is None else self.head.weight.numel() * self.head.weight.element_size()
        return sum(p.numel() * p.element_size() for p in self.adapter.parameters()) + self.cache.nbytes + head


def _adapter_step(adapter: ExitAdapter, target: Transformer, cache: HeadCache, rows: list[int], h: Tensor,
                  positions: Tensor, slots: Tensor, visible: Tensor) -> Tensor:
    """The adapter over layer-L states h [R, Q, H] at positions / slots [R, Q], seeing ``visible``
    [R, Q, S] of its cache: pre-norm states [R, Q, H]."""
    cos = target.rope_cos[positions].unsqueeze(2).to(h.dtype)  # [R, Q, 1, D]
    sin = target.rope_sin[positions].unsqueeze(2).to(h.dtype)
    rows_t = torch.tensor(rows, device=h.device)
    return adapter.layer(h, cos, sin, cache.attend(rows_t, slots, visible, adapter.config.group_size))


class _AdaptedDrafter:
    """The early exit through the adapter: each step feeds one token per row through the
    target's first L layers (on the target's cache) and the adapter (on its own, at scratch
    slots after the row's committed entries, each seeing the row's earlier scratch)."""

    def __init__(self, owner: LayerSkipProposer, cache: KVCache, base: Tensor) -> None:
        self.owner, self.cache, self.base = owner, cache, base  # base: [B] first scratch slot per row
        self.steps = 0

    def step(self, tokens: list[int]) -> Tensor:
        o = self.owner
        assert o.adapter is not None
        dev = o.target.device
        positions = self.cache.lengths_tensor()[:, None]  # [B, 1]
        out = o.target(torch.tensor(tokens, device=dev)[:, None], positions, self.cache, layers=o.layer_ids,
                       logits=False, return_hidden=(o.layers,))
        slots = self.base[:, None] + self.steps  # [B, 1]
        keys = torch.arange(int(slots.max()) + 1, device=dev)[None, None, :]  # [1, 1, S]
        visible = (keys < self.base[:, None, None]) | ((keys >= self.base[:, None, None]) & (keys <= slots[:, :, None]))
        h = _adapter_step(o.adapter, o.target, o.cache, list(range(len(tokens))), out.hidden[o.layers], positions,
                          slots, visible)  # [B, 1, H]
        self.steps += 1
        if o.head is not None:
            return o.head(o.adapter.norm(h[:, -1]))  # [B, V], -inf outside the draft vocabulary
        return o.adapter.logits(h[:, -1], o.target.lm_head)  # [B, V]


def make_layer_skip_proposer(config: LayerSkipConfig, context: ProposerContext | None) -> LayerSkipProposer:
    if context is None:
        raise SpecdraftError("method 'layer-skip' needs the target model (a ProposerContext)")
    adapter, layers = None, config.layers
    if config.adapter not in ("", "none"):  # an adapter asked for: it sets the exit layer
        adapter = load_adapter(config.adapter, context.target.config)
        layers = adapter.config.exit_layer if layers == DEFAULT_LAYERS else layers
    elif config.adapter == "" and config.last == 0 and context.source:  # the shipped one, where it fits
        path = shipped_heads("layer-skip", context.source)
        shipped = load_adapter(path, context.target.config) if path else None
        if shipped is not None and layers in (DEFAULT_LAYERS, shipped.config.exit_layer):
            adapter, layers = shipped, shipped.config.exit_layer
    return LayerSkipProposer(context.target, layers, config.branches, config.last, adapter, config.full_vocab,
                             config.stop_below, config.distinct)
