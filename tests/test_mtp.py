"""MTP modules: our checkpoints round-trip and bad ones are refused in one line; native MTP
layers in the DeepSeek-V3, Qwen3-Next and MiMo layouts load as the same module; a target that
ships one drafts with it and its greedy output equals plain decoding. (The training-time test
equivalence and greedy equality with trained-style modules run in test_eagle.py for both
kinds of head.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.engine import Engine
from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.mtp import MtpHead
from specdraft.heads.mtp_checkpoint import load_mtp, load_native_mtp, native_mtp_layout, save_mtp
from specdraft.heads.vocab import DraftVocab
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.sequence import GenerationConfig
from test_eagle import prompts, random_head


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


def test_checkpoints_round_trip_and_bad_ones_are_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    head = random_head(tiny, kind="mtp")
    folder = save_mtp(head, tmp_path / "mtp", tiny.config, "tiny")
    from safetensors.torch import load_file

    keys = set(load_file(str(folder / "model.safetensors")))
    L = tiny.config.num_layers
    assert {f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight",
            f"model.layers.{L}.shared_head.head.weight", "d2t", "t2d"} <= keys
    again = load_mtp(folder, tiny.config)
    x = torch.randn(2, 3, tiny.config.hidden_size)
    assert torch.equal(again.logits(x), head.logits(x))
    with pytest.raises(ModelFileError, match="hidden size 64") as e:
        load_mtp(folder, dataclasses.replace(tiny.config, hidden_size=32))
    assert "\n" not in str(e.value)
    c = tiny.config
    for other in (dict(vocab_size=c.vocab_size + 1), dict(num_layers=c.num_layers + 1)):  # another target
        with pytest.raises(ModelFileError, match="for a target with hidden size") as e:
            load_mtp(folder, dataclasses.replace(c, **other))
        assert "\n" not in str(e.value) and str(c.vocab_size) in str(e.value)
    with pytest.raises(ModelFileError, match="no module"):
        load_mtp(tmp_path / "nowhere", tiny.config)
    (folder / "config.json").write_text("{")
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        load_mtp(folder, tiny.config)
    with pytest.raises(SpecdraftError, match="needs a trained module"):
        make_proposer("mtp", {}, ProposerContext(tiny.model, tiny.tokenizer))


def _native_names(head: MtpHead, layout: str, num_layers: int, hidden: int) -> dict[str, torch.Tensor]:
    """The module's tensors named as ``layout`` ships them (MiMo: the projection's halves swapped)."""
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    block = {k: v for k, v in state.items() if k.split(".")[0] in
             ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")}
    own = {"enorm": state["enorm.weight"], "hnorm": state["hnorm.weight"], "eh_proj": state["eh_proj.weight"],
           "norm": state["shared_head.norm.weight"]}
    if layout == "deepseek_v3":
        p = f"model.layers.{num_layers}."
        out = {p + k: v for k, v in state.items()}
        del out[p + "shared_head.head.weight"]  # DeepSeek-V3 may share the main head: use the target's
        return out
    if layout == "qwen3_next":
        out = {"mtp.layers.0." + k: v for k, v in block.items()}
        out.update({"mtp.pre_fc_norm_embedding.weight": own["enorm"], "mtp.pre_fc_norm_hidden.weight": own["hnorm"],
                    "mtp.fc.weight": own["eh_proj"], "mtp.norm.weight": own["norm"]})
        return out
    p = "model.mtp_layers.0."
    out = {p + k: v for k, v in block.items()}
    w = own["eh_proj"]
    out.update({p + "token_layernorm.weight": own["enorm"], p + "hidden_layernorm.weight": own["hnorm"],
                p + "input_proj.weight": torch.cat([w[:, hidden:], w[:, :hidden]], 1),
                p + "final_layernorm.weight": own["norm"]})
    return out


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next", "mimo"])
def test_native_mtp_layers_load_and_draft_exactly(tiny: LoadedModel, tiny_hf: Path, tmp_path: Path, layout: str) -> None:
    from safetensors.torch import save_file

    c = tiny.config
    vocab = DraftVocab(torch.arange(c.vocab_size), c.vocab_size)
    head = random_head(tiny, draft_vocab=c.vocab_size, kind="mtp")
    with torch.no_grad():
        head.lm_head.weight.copy_(tiny.model.lm_head.weight)  # the shared head is the target's
    folder = tmp_path / layout
    shutil.copytree(tiny_hf, folder)
    save_file({k: v.contiguous() for k, v in _native_names(head, layout, c.num_layers, c.hidden_size).items()},
              str(folder / "mtp.safetensors"))
    from safetensors import safe_open

    with safe_open(str(folder / "mtp.safetensors"), "pt") as f:
        assert native_mtp_layout(set(f.keys()), c.num_layers) == layout
    native = load_native_mtp(folder, c, tiny.model.lm_head.weight)
    x, e = torch.randn(1, 4, c.hidden_size), torch.randn(1, 4, c.hidden_size)
    assert torch.equal(native.target_ids, vocab.target_ids)
    a, b = (m.enorm(e) for m in (native, head))
    assert torch.allclose(native.eh_proj(torch.cat([a, native.hnorm(x)], -1)), head.eh_proj(torch.cat([b, head.hnorm(x)], -1)))
    assert torch.allclose(native.logits(x), head.logits(x))
    # the target ships it: `--opt native=true` drafts with it, output equal to plain decoding
    target = load(folder)
    context = ProposerContext(target.model, target.tokenizer, source=str(folder))
    proposer = make_proposer("mtp", {"native": "true", "depth": "3"}, context)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    batch = prompts(target)
    plain = Engine(target.model, target.tokenizer).generate(batch, gen)
    stats = SpecStats()
    got = Engine(target.model, target.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=3))).generate(
        batch, gen, stats=stats)
    assert [r.tokens for r in got] == [r.tokens for r in plain] and stats.proposed > 0


def test_a_model_without_an_mtp_layer_is_refused_in_one_line(tiny: LoadedModel, tiny_hf: Path) -> None:
    with pytest.raises(ModelFileError, match="ships no MTP layer") as e:
        make_proposer("mtp", {"native": "true"}, ProposerContext(tiny.model, tiny.tokenizer, source=str(tiny_hf)))
    assert "\n" not in str(e.value)
    with pytest.raises(SpecdraftError, match="not both"):
        make_proposer("mtp", {"native": "true", "path": "x"}, ProposerContext(tiny.model, tiny.tokenizer))


def test_an_mtp_layer_of_another_architecture_is_refused(tiny: LoadedModel, tiny_hf: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "mla"
    shutil.copytree(tiny_hf, folder)
    L, h = tiny.config.num_layers, tiny.config.hidden_size
    save_file({f"model.layers.{L}.eh_proj.weight": torch.zeros(h, 2 * h), f"model.layers.{L}.enorm.weight": torch.ones(h),
               f"model.layers.{L}.hnorm.weight": torch.ones(h), f"model.layers.{L}.shared_head.norm.weight": torch.ones(h),
               f"model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(4, h)}, str(folder / "mtp.safetensors"))
    with pytest.raises(ModelFileError, match="not a plain Llama/Qwen2 block"):
        load_native_mtp(folder, tiny.config, tiny.model.lm_head.weight)
    assert json.loads((folder / "config.json").read_text())  # the target itself still loads
    load(folder)
