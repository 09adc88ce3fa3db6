"""An EAGLE-3 draft head (Li et al. 2025): one decoder layer over the target's token embedding
and a fused projection of the target's hidden states at a low, a middle and a high layer,
with its own LM head over a reduced draft vocabulary.

One step at position p reads the token x_{p+1} (embedded with the target's own, frozen
embedding) and a hidden state h: at a committed position h = fc([tap_low, tap_mid, tap_high])
of the target's features at p; at a drafted position h is the head's own pre-norm output of
the step before. It returns the new pre-norm state and logits for x_{p+2}:

    x = [input_layernorm(embed(x_{p+1})), hidden_norm(h)]          [2H]
    h' = h + o_proj(attention(q, k, v from x))                     (causal, with RoPE)
    h' = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))                                      [N]

Module names follow the EAGLE-3 checkpoint layout that SpecForge, SGLang and vLLM load
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so a saved head is also an
export. The head keeps no state: the caller owns the keys/values (``step``) or runs the
training-time test over whole sequences (``ttt``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor, nn

from specdraft.heads.feature_head import Attend, AttentionProjections, FeatureHead, GatedMLP, HeadConfig
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig
from specdraft.model.linear import Linear
from specdraft.model.rope import apply_rope
from specdraft.model.transformer import RMSNorm


def eagle3_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layer choice: the inputs of layers 2, L/2 and L-3 (our tap i = the output of
    the first i layers), as SGLang and vLLM capture them."""
    return (min(2, num_layers), num_layers // 2, max(num_layers - 3, 1))


class _MidLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = AttentionProjections(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)


class EagleHead(FeatureHead):
    def __init__(self, config: HeadConfig, vocab: DraftVocab) -> None:
        super().__init__(config, vocab)
        c = config
        self.fc = Linear(len(c.taps) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab, bias=False)

    @classmethod
    def for_target(cls, target: ModelConfig, vocab: DraftVocab, taps: Seq[int] | None = None) -> "EagleHead":
        """A head for ``target`` over ``vocab``, fusing ``taps`` (default: EAGLE-3's)."""
        return cls(HeadConfig.for_target(target, vocab.size, taps or eagle3_taps(target.num_layers)), vocab)

    def fuse(self, taps: Tensor) -> Tensor:
        """taps: [..., len(taps) * H] (the target's tap states, concatenated in config order) -> [..., H]."""
        return self.fc(taps.to(self.fc.weight.dtype))

    def cpp_parts(self) -> tuple[bool, list[RMSNorm], list[list[Linear]]]:
        """What ``fastpath.head_layer`` runs: norms and groups of fused products, in its order."""
        m = self.midlayer
        a = m.self_attn
        norms = [m.input_layernorm, m.hidden_norm, m.post_attention_layernorm, self.norm]
        return True, norms, [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.mlp.gate_proj, m.mlp.up_proj],
                             [m.mlp.down_proj], [self.lm_head]]

    def layer(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """emb, hidden: [B, T, H]; cos, sin: [B, T, 1, D] -> the new pre-norm states [B, T, H]."""
        c, m = self.config, self.midlayer
        b, t, _ = hidden.shape
        x = torch.cat([m.input_layernorm(emb.to(hidden.dtype)), m.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        a = m.self_attn
        q = apply_rope(a.q_proj(x).view(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(a.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        v = a.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        out = attend(q, k, v).transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)  # [B, T, Hq*D]
        h = hidden + a.o_proj(out)
        return h + m.mlp(m.post_attention_layernorm(h))

