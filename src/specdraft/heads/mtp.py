"""A multi-token-prediction module in DeepSeek-V3's layout (DeepSeek-AI 2024), trained post hoc
here, or loaded where a model ships one (DeepSeek-V3, Qwen3-Next and MiMo key layouts).

One step at position p reads the target's last-layer state h (before the final norm; at a
drafted position the module's own output of the step before) and the embedding of x_{p+1}:

    x = eh_proj([enorm(embed(x_{p+1})), hnorm(h)])                  [H]
    x = x + attention(input_layernorm(x))                           (one Llama block)
    h' = x + mlp(post_attention_layernorm(x))
    logits = shared_head.head(shared_head.norm(h'))                 [N]

Unlike EAGLE-3 the residual stream starts at the projection, the block is a plain decoder
layer, and the input is the last layer only (tap L). Module names are DeepSeek-V3's, so
``state_dict`` keys prefixed with ``model.layers.{L}.`` are its checkpoint layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specdraft.heads.feature_head import Attend, AttentionProjections, FeatureHead, GatedMLP, HeadConfig
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig
from specdraft.model.linear import Linear
from specdraft.model.rope import apply_rope
from specdraft.model.transformer import RMSNorm


class _SharedHead(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.draft_vocab, bias=False)


class MtpHead(FeatureHead):
    def __init__(self, config: HeadConfig, vocab: DraftVocab, attention_bias: bool = False) -> None:
        super().__init__(config, vocab)
        c = config
        if len(c.taps) != 1:
            raise ValueError("an MTP module reads one tap (the target's last layer)")
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = AttentionProjections(c, c.hidden_size, bias=attention_bias)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.shared_head = _SharedHead(c)
        self.attention_bias = attention_bias

    @classmethod
    def for_target(cls, target: ModelConfig, vocab: DraftVocab) -> "MtpHead":
        """A module for ``target`` over ``vocab``, reading its last layer."""
        return cls(HeadConfig.for_target(target, vocab.size, (target.num_layers,)), vocab, target.attention_bias)

    @property
    def norm(self) -> nn.Module:  # the read-out FeatureHead.logits uses
        return self.shared_head.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.shared_head.head

    def fuse(self, taps: Tensor) -> Tensor:
        """taps: [..., H], the target's last-layer state -> [..., H] (as it is)."""
        return taps.to(self.eh_proj.weight.dtype)

    def cpp_parts(self) -> tuple[bool, list[RMSNorm], list[list[Linear]]]:
        """What ``fastpath.head_layer`` runs: norms and groups of fused products, in its order."""
        a, m = self.self_attn, self.mlp
        norms = [self.enorm, self.hnorm, self.input_layernorm, self.post_attention_layernorm, self.shared_head.norm]
        return False, norms, [[self.eh_proj], [a.q_proj, a.k_proj, a.v_proj], [a.o_proj],
                              [m.gate_proj, m.up_proj], [m.down_proj], [self.shared_head.head]]

    def layer(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """emb, hidden: [B, T, H]; cos, sin: [B, T, 1, D] -> the new pre-norm states [B, T, H]."""
        c, a = self.config, self.self_attn
        b, t, _ = hidden.shape
        x = self.eh_proj(torch.cat([self.enorm(emb.to(hidden.dtype)), self.hnorm(hidden)], dim=-1))  # [B, T, H]
        y = self.input_layernorm(x)
        q = apply_rope(a.q_proj(y).view(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(a.k_proj(y).view(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        v = a.v_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        x = x + a.o_proj(attend(q, k, v).transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))
