"""What every feature head shares (EAGLE-3, MTP): a head reads the target's features at a
committed position (``fuse``) or its own state at a drafted one, and the embedding of the next
token; one step (``layer``) gives a new state whose ``logits`` predict the token after. The
caller owns the keys/values (``attend``); ``ttt`` runs EAGLE-3's training-time test over whole
sequences, which drafting reproduces exactly (tests/test_eagle.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig
from specdraft.model.linear import Linear
from specdraft.model.transformer import grouped_attention


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """A feature head's shape: the target's attention/MLP shape, the taps it reads, the draft vocabulary."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    taps: tuple[int, ...]
    draft_vocab: int
    target_vocab: int
    target_layers: int

    def __post_init__(self) -> None:
        if not self.taps or any(not 0 <= t <= self.target_layers for t in self.taps):
            raise SpecdraftError(f"head: taps must be layer outputs in 0..{self.target_layers}, got {self.taps}")
        if not 1 <= self.draft_vocab <= self.target_vocab or self.num_heads % self.num_kv_heads:
            raise SpecdraftError(f"head: need 1 <= draft_vocab <= target_vocab and whole query groups, got {self}")

    @classmethod
    def for_target(cls, c: ModelConfig, draft_vocab: int, taps: Seq[int]) -> "HeadConfig":
        return cls(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
                   tuple(taps), draft_vocab, c.vocab_size, c.num_layers)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


class AttentionProjections(nn.Module):
    """A Llama layer's q/k/v/o projections under Hugging Face's names (``q_proj`` ...), from
    ``inputs`` features (EAGLE-3's first layer reads 2H). ``shape``: anything with
    hidden_size, num_heads, num_kv_heads and head_dim."""

    def __init__(self, shape: "HeadConfig | object", inputs: int, bias: bool = False) -> None:
        super().__init__()
        c = shape
        self.q_proj = Linear(inputs, c.num_heads * c.head_dim, bias=bias)  # type: ignore[attr-defined]
        self.k_proj = Linear(inputs, c.num_kv_heads * c.head_dim, bias=bias)  # type: ignore[attr-defined]
        self.v_proj = Linear(inputs, c.num_kv_heads * c.head_dim, bias=bias)  # type: ignore[attr-defined]
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)  # type: ignore[attr-defined]


class GatedMLP(nn.Module):
    """A Llama layer's MLP under Hugging Face's names: down(SiLU(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


# attend(q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]) -> [B, Hq, T, D]: how the new
# queries see keys (the caller's cache, or the training-time test's key sets)
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class FeatureHead(nn.Module):
    """The shared part: the config, the draft vocabulary, the read-out and the training-time
    test. Subclasses give ``fuse`` and ``layer`` and own ``norm`` and ``lm_head``."""

    config: HeadConfig
    norm: nn.Module
    lm_head: nn.Module

    def __init__(self, config: HeadConfig, vocab: DraftVocab) -> None:
        super().__init__()
        if vocab.size != config.draft_vocab or vocab.target_size != config.target_vocab:
            raise SpecdraftError("head: the draft vocabulary does not match the head's config")
        self.config = config
        self.register_buffer("target_ids", vocab.target_ids.clone(), persistent=False)  # [N] draft id -> target id

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.target_ids.cpu(), self.config.target_vocab)

    def fuse(self, taps: Tensor) -> Tensor:
        """taps: [..., len(taps) * H] (the target's tap states, concatenated in config order) -> [..., H]."""
        raise NotImplementedError

    def layer(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """emb, hidden: [B, T, H]; cos, sin: [B, T, 1, D] -> the new pre-norm states [B, T, H]."""
        raise NotImplementedError

    def cpp_parts(self) -> "tuple[bool, list[nn.Module], list[list[Linear]]] | None":
        """The norms and groups of fused products ``fastpath.head_layer`` runs in place of ``layer``
        and ``logits`` (None: no C++ step; a subclass changing either must say None)."""
        return None

    def logits(self, prenorm: Tensor) -> Tensor:
        """[..., H] pre-norm states -> [..., N] float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(prenorm)).float()

    def ttt(self, taps: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, steps: int) -> list[Tensor]:
        """Run ``steps`` draft steps from every position at once, each fed the head's own state
        of the step before, as drafting does (EAGLE-3's training-time test).

        taps: [B, T, len(taps) * H], the target's features at positions 0..T-1;
        emb: [B, T + steps, H], embed(x_0 .. x_{T+steps-1}) (zeros past the sequence);
        cos, sin: [B, T + steps, 1, D] for positions 0..T+steps-1.
        Step k (1-based) from anchor p sits at position p + k - 1, reads x_{p+k}, and sees the
        committed (step-1) keys of positions 0..p and its own chain's keys of steps 2..k.
        Returns the pre-norm states of each step: a list of ``steps`` [B, T, H]; step k's
        logits at anchor p predict x_{p+k+1}.
        """
        t = taps.shape[1]
        hidden = self.fuse(taps)  # [B, T, H]
        keys: list[tuple[Tensor, Tensor]] = []
        states = []
        for k in range(steps):
            attend = _TTTAttention(keys, self.config.group_size)
            hidden = self.layer(emb[:, k + 1 : k + 1 + t], hidden, cos[:, k : k + t], sin[:, k : k + t], attend)
            keys.append((attend.k, attend.v))
            states.append(hidden)
        return states



class _TTTAttention:
    """Attention of one training-time-test step: causal over the step-1 keys, plus, per anchor,
    the same anchor's keys of the later steps (a diagonal each). Records its own k, v."""

    def __init__(self, earlier: list[tuple[Tensor, Tensor]], group: int) -> None:
        self.earlier = earlier
        self.group = group
        self.k = self.v = torch.empty(0)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.k, self.v = k, v
        if not self.earlier:  # step 1: plain causal attention
            t = q.shape[2]
            return grouped_attention(q, k, v, None if t == 1 else causal_mask(t, self.group, q.device), self.group)
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        qg = q.view(b, hkv, self.group, t, d)  # [B, Hkv, G, T, D]
        k1, v1 = self.earlier[0]  # [B, Hkv, T, D]
        scale = d ** -0.5
        causal = torch.einsum("bhgtd,bhsd->bhgts", qg, k1) * scale  # [B, Hkv, G, T, T]
        causal = causal.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        chain = [*self.earlier[1:], (k, v)]
        diag = torch.stack([torch.einsum("bhgtd,bhtd->bhgt", qg, kk) * scale for kk, _ in chain], -1)  # [B, Hkv, G, T, C]
        w = torch.cat([causal, diag], -1).float().softmax(-1).to(q.dtype)  # [B, Hkv, G, T, T + C]
        out = torch.einsum("bhgts,bhsd->bhgtd", w[..., :t], v1)
        for i, (_, vv) in enumerate(chain):
            out = out + w[..., t + i, None] * vv[:, :, None]  # [B, Hkv, G, T, D]
        return out.reshape(b, hq, t, d)


def causal_mask(t: int, group: int, device: torch.device) -> Tensor:
    """[G*T, T] causal mask in ``grouped_attention``'s stacked-query order (g * T + t)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril().repeat(group, 1)


def ttt_inputs(embed: nn.Embedding, tokens: Tensor, rope_cos: Tensor, rope_sin: Tensor, steps: int,
               dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(emb [B, T + steps, H], cos, sin [B, T + steps, 1, D]) for ``EagleHead.ttt`` from the
    tokens [B, T] and the target's embedding and RoPE tables."""
    b, t = tokens.shape
    with torch.no_grad():
        emb = embed(tokens.to(embed.weight.device)).to(dtype)  # [B, T, H]
    emb = torch.cat([emb, emb.new_zeros(b, steps, emb.shape[-1])], 1)  # [B, T + steps, H]
    pos = torch.arange(t + steps, device=rope_cos.device)
    cos = rope_cos[pos][None, :, None].expand(b, -1, -1, -1).to(dtype)  # [B, T + steps, 1, D]
    sin = rope_sin[pos][None, :, None].expand(b, -1, -1, -1).to(dtype)
    return emb, cos, sin
