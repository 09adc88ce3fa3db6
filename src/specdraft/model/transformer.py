"""A Llama-family decoder (Llama / SmolLM, Mistral, Qwen2) in plain PyTorch.

One forward for every use: prefill, plain decoding, chain and tree verification, early exit
(self-speculation) and hidden-state taps (Medusa / EAGLE). Everything is passed explicitly;
nothing is stored on the modules between calls except the weights and the RoPE table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import ContextOverflowError
from specdraft.model import fastpath
from specdraft.model.config import ModelConfig
from specdraft.model.kv_cache import KVCache
from specdraft.model.linear import Linear
from specdraft.model.rope import apply_rope, rope_table


# Packed forwards split their attention (``split_attention``) where at most SPLIT_SHARE of the
# rows drafted and the forward is at least SPLIT_FROM_WIDTH tokens wide. Measured on the default
# model (bfloat16, 64 rows, ~300 cached tokens, an AVX2-only EPYC), forward ms, split / padded:
# 1 row drafting 1: 391 / 362, drafting 4: 421 / 480, drafting 8: 459 / 581; 16 rows drafting
# 2: 524 / 486, drafting 4: 596 / 616, drafting 8: 814 / 863; 32 rows drafting 1: 523 / 429,
# drafting 4: 797 / 740 (plain 370). The second call re-reads the deep rows' keys, which costs
# more than a padded attention's few extra queries unless the drafts are wide and the rows few;
# at half the rows (the rule before) the split cost suffix's drafting steps at 64 rows ~35%.
SPLIT_SHARE = 0.25
SPLIT_FROM_WIDTH = 5  # 1 + 4 draft tokens
WIDE_FROM_ROWS = 16  # 4-bit weights: products with this many rows use the dense path (quant.py)


def numerics_version(batch_invariant: bool, int4: bool = False) -> int:
    """Bumped whenever a change alters the bits a forward computes for the same inputs (part of
    the key of `specdraft verify`'s cache of plain outputs). Batch-invariant 2: prompts attend
    one call per row (`prompt_attention`); 3: one-row products run as two rows (`linear.py`);
    4: a lone decoding token attends without the per-token wrapping (the same kernel call);
    5: attention through ``csrc/attend.h`` where it applies (the CPU with the C++ extension).
    Otherwise 2: float32 products of 1-3 rows take the packed path too (``linear.py``).
    int4: 4-bit products (and the 8-bit LM head) through ``csrc/quantmm.h`` (where it runs) add
    10 to either."""
    tiles = 10 if int4 and fastpath.quant_path() != "torch" else 0
    if not batch_invariant:
        return 2 + tiles
    return (5 if fastpath.extension() is not None else 4) + tiles


@dataclass(slots=True)
class ModelOutput:
    logits: Tensor | None  # [B, T, V] float32, or None when not asked for
    last_hidden: Tensor  # [B, T, H] after the final norm (the LM head's input)
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer i -> [B, T, H] output of layer i (0 = embeddings)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # x: [..., H]
        if x.dtype in (torch.float32, torch.bfloat16) and x.dtype == self.weight.dtype:
            # bfloat16: the kernel computes in float32 and rounds once, the same bits as the
            # float32 route below (checked), with no conversions
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Block(nn.Module):
    """One decoder layer with fused q/k/v and gate/up projections."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.wqkv = Linear(c.hidden_size, q + 2 * kv, bias=c.attention_bias)
        self.wo = Linear(q, c.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.w_gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.w_down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache, layer: int,
        plan: "KeyPlan | PromptRows | None" = None, wide: bool = False, packing: "Packing | None" = None,
    ) -> Tensor:
        """x: [B, T, H], or [N, H] with ``packing`` (the real tokens alone); cos, sin: [B, T, 1, D];
        mask: [B, 1, G*T, S] bool (True = attend) or None; plan: batch-invariant attention, per
        query (KeyPlan) or per prompt row (PromptRows); None = one fused call. wide: see
        ``Linear.forward``."""
        # (submodules' forward called directly: they have no hooks, and a decode step makes
        # 210 of these calls, where nn.Module.__call__ alone would cost ~0.5 ms)
        x = x + self.attention(self.attn_norm.forward(x), cos, sin, mask, cache, layer, plan, wide, packing)
        gate, up = self.w_gate_up.forward(self.ffn_norm.forward(x), wide).chunk(2, dim=-1)
        return x + self.w_down.forward(F.silu(gate) * up, wide)

    def attention(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache, layer: int,
        plan: "KeyPlan | PromptRows | None" = None, wide: bool = False, packing: "Packing | None" = None,
    ) -> Tensor:
        c = self.c
        b, t = cos.shape[:2]
        hq, hkv = c.num_heads, c.num_kv_heads
        qkv = self.wqkv.forward(x, wide)  # [B, T, (Hq + 2 Hkv) D], or [N, ...] packed
        if packing is not None:
            qkv = packing.pad(qkv)  # [B, T, (Hq + 2 Hkv) D], padding zero
        qkv = qkv.view(b, t, hq + 2 * hkv, c.head_dim)  # [B, T, Hq + 2 Hkv, D]
        qk = apply_rope(qkv[:, :, : hq + hkv], cos, sin)  # [B, T, Hq + Hkv, D], one call for q and k
        q = qk[:, :, :hq].transpose(1, 2)  # [B, Hq, T, D]
        k = qk[:, :, hq:].transpose(1, 2)  # [B, Hkv, T, D]
        v = qkv[:, :, hq + hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        keys, values = cache.write(layer, k, v)  # [B, Hkv, S, D]
        if plan is None and packing is not None and packing.deep is not None and mask is not None:
            out = split_attention(q, keys, values, mask, c.group_size, packing.deep)  # [B, Hq, T, D]
        elif plan is None:
            out = grouped_attention(q, keys, values, mask, c.group_size)  # [B, Hq, T, D]
        elif isinstance(plan, PromptRows):
            out = prompt_attention(q, keys, values, plan, c.group_size)  # [B, Hq, T, D]
        else:
            out = invariant_attention(q, keys, values, plan, c.group_size)  # [B, Hq, T, D]
        flat = out.transpose(1, 2).reshape(b, t, hq * c.head_dim)  # [B, T, Hq D]
        if packing is not None:
            flat = packing.pick(flat)  # [N, Hq D]
        return self.wo.forward(flat, wide)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, group: int) -> Tensor:
    """Grouped-query attention without repeating K/V: the ``group`` query heads that share a
    key/value head are stacked along the query axis, making it plain multi-head attention over
    the key/value heads (one fused SDPA call).

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, G*T, S] bool or None. Returns [B, Hq, T, D].
    """
    b, hq, t, d = q.shape
    qg = q.reshape(b, k.shape[1], group * t, d)  # head h = kv * group + g
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # [B, Hkv, G*T, D]
    return out.view(b, hq, t, d)


def split_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, group: int, deep: Tensor) -> Tensor:
    """``grouped_attention`` for a packed forward in which few rows carry more than their root:
    every row's root token in one call over all rows, then the ``deep`` rows' other slots in one
    call over those rows' keys alone (copied out), instead of every row's padding attending to
    every key. Slots of other rows past the root come back zero (padding nobody reads).

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, G*T, S] bool; deep: [R] row indices.
    Returns [B, Hq, T, D]."""
    b, hq, t, d = q.shape
    hkv, r = k.shape[1], deep.shape[0]
    m = mask.view(b, 1, group, t, mask.shape[-1])  # [B, 1, G, T, S]
    roots = F.scaled_dot_product_attention(q[:, :, 0].reshape(b, hkv, group, d), k, v,
                                           attn_mask=m[:, :, :, 0])  # [B, Hkv, G, D]
    out = q.new_zeros(b, hq, t, d)
    out[:, :, 0] = roots.view(b, hq, d)
    qd = q.index_select(0, deep)[:, :, 1:].reshape(r, hkv, group * (t - 1), d)  # [R, Hkv, G*(T-1), D]
    md = m.index_select(0, deep)[:, :, :, 1:].reshape(r, 1, group * (t - 1), m.shape[-1])  # [R, 1, G*(T-1), S]
    rest = F.scaled_dot_product_attention(qd, k.index_select(0, deep), v.index_select(0, deep), attn_mask=md)
    out[:, :, 1:].index_copy_(0, deep, rest.view(r, hq, t - 1, d))  # [R, Hq, T-1, D] into the deep rows
    return out


# For each row, for each new token: the keys it sees, as a count (the first n positions, the
# common case) or an index tensor [n] (a tree node: the prefix and its ancestors, in order).
KeyPlan = list[list["int | Tensor"]]


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, plan: KeyPlan, group: int) -> Tensor:
    """Attention whose result for a token does not depend on how many tokens or rows share the
    forward. Fused SDPA kernels pick their blocking from the query count and mask, which
    changes the rounding (enough to flip greedy choices in bfloat16 after a few dozen tokens).
    On the CPU with the C++ extension: ``csrc/attend.h``, invariant by construction (one task
    per query and key/value head, an order fixed by the key count alone). Otherwise each query
    token makes exactly the call a one-token decoding step makes (its visible keys, no mask).

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]. Returns [B, Hq, T, D]."""
    b_, hq, t_, d = q.shape
    hkv = k.shape[1]
    by_query = q.transpose(1, 2).reshape(b_ * t_, hkv, group, d)  # [B*T, Hkv, G, D]
    flat = [n for row in plan for n in row]
    counts = [n if isinstance(n, int) else -1 for n in flat]  # -1: the next of picks
    out = fastpath.attend(by_query, k, v, [i // t_ for i in range(b_ * t_)], counts,
                          [n for n in flat if not isinstance(n, int)])  # [B*T, Hkv, G, D] | None
    if out is not None:  # csrc/attend.h: invariant by construction, as the C++ loop attends
        return out.view(b_, t_, hq, d).transpose(1, 2)
    if b_ == 1 and t_ == 1 and plan[0][0] == k.shape[2]:  # one decoding token: the same call, unwrapped
        qt = q.reshape(1, hkv, group, d).contiguous()  # [1, Hkv, G, D]
        return F.scaled_dot_product_attention(qt, k, v).view(1, hq, 1, d)
    by_token = q.transpose(1, 2).contiguous()  # [B, T, Hq, D]: each token's heads contiguous
    outs = []
    for b, row in enumerate(plan):
        for t, sel in enumerate(row):
            kb = k[b : b + 1, :, :sel] if isinstance(sel, int) else k[b : b + 1, :, sel]  # [1, Hkv, n, D]
            vb = v[b : b + 1, :, :sel] if isinstance(sel, int) else v[b : b + 1, :, sel]
            qt = by_token[b, t].view(1, hkv, group, d)  # [1, Hkv, G, D]: the group's heads stacked
            outs.append(F.scaled_dot_product_attention(qt, kb, vb))  # [1, Hkv, G, D]
    return torch.stack(outs).view(b_, t_, hq, d).transpose(1, 2)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A chunk of prompts in a batch-invariant model: row b's first ``real[b]`` new tokens are
    its prompt, after ``lengths[b]`` cached ones (the rest of the row is padding); ``masks[b]``
    is its causal mask over its own keys (None for a row without prompt tokens here)."""

    lengths: list[int]
    real: list[int]
    masks: list[Tensor | None]

    @classmethod
    def build(cls, lengths: list[int], real: list[int], group: int, device: torch.device) -> "PromptRows":
        masks: list[Tensor | None] = []
        for n, r in zip(lengths, real):
            seen = torch.arange(n + r, device=device)[None, :] <= n + torch.arange(r, device=device)[:, None]  # [r, n + r]
            masks.append(seen.repeat(group, 1)[None, None] if r else None)  # [1, 1, G*r, n + r], stacked-query order
        return cls(lengths, real, masks)


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, rows: PromptRows, group: int) -> Tensor:
    """Causal attention over each row's own prompt tokens, one fused call per row whose shapes
    depend on that row alone (its cached length and real token count), so a row's prompt
    gets the same bits whatever its batch mates. Prompt tokens are never compared with
    one-token steps (plain and speculative decoding prefill the same way), so one call per row
    is enough; padding positions are left zero.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]. Returns [B, Hq, T, D]."""
    out = torch.zeros_like(q)
    for b, (n, r, mask) in enumerate(zip(rows.lengths, rows.real, rows.masks)):
        if mask is None:
            continue
        s = n + r
        out[b : b + 1, :, :r] = grouped_attention(q[b : b + 1, :, :r], k[b : b + 1, :, :s], v[b : b + 1, :, :s], mask, group)
    return out


def key_plan(lengths: list[int], t: int, full_mask: Tensor | None) -> KeyPlan:
    """The keys each new token sees, from the committed lengths and the [B, 1, 1, T, S] mask
    (None = every row sees all its keys)."""
    if full_mask is None:
        return [[n + t] * t for n in lengths]
    plan: KeyPlan = []
    for b, n in enumerate(lengths):
        row: list[int | Tensor] = []
        for i in range(t):
            idx = full_mask[b, 0, 0, i].nonzero().flatten()  # [n_visible]
            count = idx.numel()
            contiguous = count == 0 or int(idx[-1]) == count - 1
            row.append(count if contiguous else idx)
        plan.append(row)
    return plan


def splits(deep: int, rows: int, width: int) -> bool:
    """Whether a packed forward of ``rows`` rows, ``width`` tokens wide, ``deep`` of them
    carrying more than a root, splits its attention (``SPLIT_SHARE``, ``SPLIT_FROM_WIDTH``)."""
    return width >= SPLIT_FROM_WIDTH and 0 < deep <= SPLIT_SHARE * rows


@dataclass(frozen=True, slots=True)
class Packing:
    """Which tokens of a [B, T] forward are real: row b's first ``real[b]``, the rest padding
    (a verification step's rows drafted different numbers of tokens; an idle row none). The
    per-token work (embedding, norms, projections, MLP, LM head) then runs on the N real tokens
    alone, packed in row order; attention and the cache keep the padded [B, T] layout, with
    zero queries, keys and values at the padding, which no real token sees."""

    index: Tensor  # [N] int64: the real tokens' flat positions b * T + i
    rows: int  # B
    width: int  # T
    deep: Tensor | None = None  # [R] int64: the rows with more than a root, where attention is split

    @classmethod
    def of(cls, real: list[int], t: int, device: torch.device) -> "Packing | None":
        """None where every token is real (nothing to skip) or none is. Where at most
        ``SPLIT_SHARE`` of the rows carry more than one token and the forward is at least
        ``SPLIT_FROM_WIDTH`` wide, attention (not batch-invariant) is split
        (``split_attention``)."""
        if any(not 0 <= r <= t for r in real):
            raise ValueError(f"real must give 0..{t} tokens per row, got {real}")
        n = sum(real)
        if n == len(real) * t or n == 0:
            return None
        index = torch.tensor([b * t + i for b, r in enumerate(real) for i in range(r)], device=device)  # [N]
        deep = [b for b, r in enumerate(real) if r > 1]
        split = splits(len(deep), len(real), t)
        return cls(index, len(real), t, torch.tensor(deep, device=device) if split else None)

    def pick(self, x: Tensor) -> Tensor:
        """[B, T, ...] -> [N, ...]: the real tokens' entries."""
        return x.reshape(self.rows * self.width, *x.shape[2:]).index_select(0, self.index)

    def pad(self, x: Tensor) -> Tensor:
        """[N, ...] -> [B, T, ...]: the real tokens' entries in place, zero at the padding."""
        full = x.new_zeros((self.rows * self.width, *x.shape[1:])).index_copy_(0, self.index, x)  # [B*T, ...]
        return full.view(self.rows, self.width, *x.shape[1:])


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, batch_invariant: bool = False) -> None:
        """batch_invariant: compute every token exactly as a one-token step would (attention one
        query at a time, packed linears for single rows too), so speculative verification and
        batching cannot change a greedy choice in any dtype, at some speed cost."""
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.fast_path = True  # run the layers from C++ where that applies (fastpath.py); False: Python
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_table(config, config.max_position, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)  # [S, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [S, D]

    def pack_weights(self, enable: bool = True) -> None:
        """Make (or drop) the oneDNN-packed weight copies used for CPU inference (and forget the
        C++ layer loop's capture of the weights: call this after changing weights in place)."""
        fastpath.drop(self)
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(single_rows=self.batch_invariant) if enable else m.unpack()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, batch_size: int, capacity: int | None = None) -> KVCache:
        cap = self.config.max_context if capacity is None else capacity
        return KVCache.allocate(self.config, batch_size, cap, dtype=self.dtype, device=self.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        mask: Tensor | None = None,
        *,
        num_layers: int | None = None,
        layers: tuple[int, ...] | None = None,
        return_hidden: tuple[int, ...] = (),
        logits: bool = True,
        prompt: list[int] | None = None,
        real: list[int] | None = None,
    ) -> ModelOutput:
        """Run the new tokens of every row against that row's cached prefix.

        tokens:     [B, T] int64, appended after each row's committed cache length.
        positions:  [B, T] int64 RoPE positions (a tree node's position is its depth).
        cache:      the rows' KV cache; the T new positions are appended to every row and
                    counted in ``cache.lengths`` (roll back with ``truncate`` / ``commit``).
        mask:       None = causal over the new tokens. Otherwise bool, True = may attend:
                    [B, T, T] over the new tokens (the committed prefix is always visible), or
                    [B, T, max(lengths) + T] over cached + new positions.
        num_layers: run only the first L layers, then the final norm and LM head (early exit).
        layers:     run only these layers (increasing indices; e.g. the first and the last few,
                    skipping a middle block), then the final norm and LM head. Excludes num_layers.
        return_hidden: layer indices i whose outputs to return (0 = embeddings, L = last layer).
        logits:     compute the LM head (False when only hidden states are needed).
        prompt:     a prefill chunk (causal, mask None): row b's first prompt[b] tokens are its
                    prompt, the rest padding. A batch-invariant model then attends one call per
                    row instead of one per token (see ``prompt_attention``); others ignore it.
        real:       row b's first real[b] tokens are real, the rest padding whose outputs nobody
                    reads (a verification step's shorter drafts, idle rows: 0): the per-token
                    work runs on the real tokens alone (``Packing``), and the padding's logits,
                    hidden states and cached keys and values come back zero. A real token's
                    outputs are those of the padded forward (bit for bit in a batch-invariant
                    model: its products do not depend on the row count).
        """
        c = self.config
        b, t = tokens.shape
        ids = self._layer_ids(num_layers, layers)
        cache.check_room(t)
        if int(positions.max()) >= c.max_position:
            raise ContextOverflowError(
                f"position {int(positions.max())} is past the model's context of {c.max_position}"
            )
        plan: KeyPlan | PromptRows | None = None
        full_mask = None
        if self.batch_invariant and prompt is not None and mask is None:  # no full mask needed
            if len(prompt) != b or not all(0 <= r <= t for r in prompt):
                raise ValueError(f"prompt must give 0..{t} real tokens for each of {b} rows, got {prompt}")
            plan = PromptRows.build(list(cache.lengths), list(prompt), c.group_size, tokens.device)
        else:
            full_mask = attention_mask(cache.lengths, t, mask, tokens.device)  # [B, 1, 1, T, S] | None
            plan = key_plan(cache.lengths, t, full_mask) if self.batch_invariant else None
        if full_mask is not None:  # to SDPA's layout over the stacked query heads: [B, 1, G*T, S]
            g = c.group_size
            full_mask = full_mask.expand(b, 1, g, t, full_mask.shape[-1]).reshape(b, 1, g * t, -1)
        cos = self.rope_cos[positions].unsqueeze(2).to(self.dtype)  # [B, T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(2).to(self.dtype)  # [B, T, 1, D], sign folded in
        packing = None if real is None else Packing.of(list(real), t, tokens.device)
        x = self.embed(tokens if packing is None else packing.pick(tokens))  # [B, T, H], or [N, H] packed
        hidden = {0: x} if 0 in return_hidden else {}
        # 4-bit weights: prompt chunks (never compared with one-token steps, see prompt_attention)
        # and, where exactness across row counts is not promised, any wide product take the
        # dense packed path
        wide = prompt is not None or (not self.batch_invariant and x.numel() // x.shape[-1] >= WIDE_FROM_ROWS)
        fast = self._fast_layers(plan)
        if fast is not None:  # the same calls from C++ (fastpath.py)
            flat = [] if plan is None else [n for row in plan for n in row]
            counts = [n if isinstance(n, int) else -1 for n in flat]  # -1: the next of picks
            picks = [n for n in flat if not isinstance(n, int)]  # tree nodes' key indices
            hit = [i + 1 for i in ids if i + 1 in return_hidden]  # layer outputs to return, in run order
            x, *taps = fast.forward(x, cos, sin, cache.k, cache.v, list(cache.lengths), full_mask, counts, picks,
                                    list(ids), hit, wide, None if packing is None else packing.index,
                                    None if packing is None else packing.deep)
            hidden.update(zip(hit, taps))
        else:
            for i in ids:
                x = self.layers[i](x, cos, sin, full_mask, cache, i, plan, wide, packing)
                if i + 1 in return_hidden:
                    hidden[i + 1] = x
        cache.advance(t)
        x = self.norm(x)
        out = self.lm_logits(x) if logits else None  # [B, T, V], or [N, V] packed
        if packing is not None:  # back to [B, T, ...], the padding zero
            out = None if out is None else packing.pad(out)
            x = packing.pad(x)
            hidden = {i: packing.pad(h) for i, h in hidden.items()}
        return ModelOutput(logits=out, last_hidden=x, hidden=hidden)

    def _fast_layers(self, plan: "KeyPlan | PromptRows | None") -> Any:
        """The C++ layer loop where it applies (fastpath.py), else None: CPU inference with a
        fused attention call or a key plan (prompt rows run here)."""
        if not self.fast_path or torch.is_grad_enabled() or self.device.type != "cpu":
            return None
        if isinstance(plan, PromptRows):
            return None
        return fastpath.layers_for(self)

    def _layer_ids(self, num_layers: int | None, layers: tuple[int, ...] | None) -> range | tuple[int, ...]:
        total = self.config.num_layers
        if layers is not None:
            if num_layers is not None:
                raise ValueError("give num_layers or layers, not both")
            if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < total:
                raise ValueError(f"layers must be increasing indices in 0..{total - 1}, got {layers}")
            return layers
        depth = total if num_layers is None else num_layers
        if not 1 <= depth <= total:
            raise ValueError(f"num_layers must be in 1..{total}, got {depth}")
        return range(depth)

    def lm_logits(self, last_hidden: Tensor) -> Tensor:
        """The LM head on final-norm hidden states: [..., H] -> [..., V] float32."""
        return self.lm_head(last_hidden).float()


def attention_mask(lengths: list[int], t: int, mask: Tensor | None, device: torch.device) -> Tensor | None:
    """Build the [B, 1, 1, T, S] boolean mask (S = max(lengths) + T) from committed lengths
    and the mask over the new tokens. Returns None when every query may see every key."""
    b, s = len(lengths), max(lengths) + t
    if mask is not None and mask.shape[-1] == s and mask.shape[-1] != t:
        return mask.to(device=device, dtype=torch.bool).view(b, 1, 1, t, s)
    if mask is None and t == 1 and min(lengths) == max(lengths):
        return None
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)  # [B, T, T]
    lens = torch.tensor(lengths, device=device)[:, None]  # [B, 1]
    rel = torch.arange(s, device=device)[None, :] - lens  # [B, S] key index relative to the new block
    in_new = (rel >= 0) & (rel < t)  # [B, S]
    idx = rel.clamp(0, t - 1)[:, None, :].expand(b, t, s)  # [B, T, S]
    new_part = torch.gather(mask.to(device=device, dtype=torch.bool), 2, idx) & in_new[:, None, :]
    full = new_part | (rel < 0)[:, None, :]  # [B, T, S]
    return full.view(b, 1, 1, t, s)
