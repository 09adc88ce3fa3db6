"""4-bit weights (``--dtype int4``): GGUF Q4_0 / Q4_1 blocks read as stored, float weights
quantized, the CPU kernel's products, and the model built on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdraft.model.load_gguf import load_gguf, unpermute_rows
from specdraft.model.loader import build_transformer, load
from specdraft.model.quant import GROUP, Int4Packed, Int4Weight, int4_kernel_available, rows_invariant
from tiny_models import write_gguf_model, write_hf_model

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="torch has no CPU int4 kernel")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 and 512 inputs (multiples of the 32-input blocks)."""
    return write_hf_model(tmp_path_factory.mktemp("int4") / "tiny-256", "llama", seed=5, hidden=256,
                          intermediate=512, heads=4, kv_heads=2)


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1"])
def q4_file(request: pytest.FixtureRequest, folder: Path) -> Path:
    return write_gguf_model(folder.parent / f"tiny-{request.param}.gguf", folder, qtype=request.param)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, tokens.shape[1])).logits[0]


def test_q4_blocks_are_read_as_stored(q4_file: Path) -> None:
    """The layer matrices stay 4-bit, and their values are gguf's own dequantization of the
    same blocks (un-permuted like the float path); embeddings are never kept 4-bit."""
    _, floats, _ = load_gguf(q4_file)
    _, kept, _ = load_gguf(q4_file, int4=True)
    four_bit = [name for name, w in kept.items() if isinstance(w, Int4Weight)]
    assert len(four_bit) == 2 * 7 + 1  # q, k, v, o, gate, up, down in each of 2 layers; the output
    assert not isinstance(kept["model.embed_tokens.weight"], Int4Weight)
    for name in four_bit:
        w = kept[name]
        assert w.q.dtype == torch.uint8 and int(w.q.max()) <= 15
        assert w.scale.shape == (w.shape[0], w.shape[1] // GROUP)
        torch.testing.assert_close(w.dequantize(), floats[name], rtol=1e-6, atol=1e-6, msg=name)


def test_row_permutation_of_4bit_weights_matches_the_float_one() -> None:
    w = Int4Weight.quantize(torch.randn(8 * 16, 64))
    torch.testing.assert_close(unpermute_rows(w, 8).dequantize(), unpermute_rows(w.dequantize(), 8))


def test_quantize_is_within_half_a_step_and_rejects_ragged_rows() -> None:
    x = torch.randn(48, 128)
    x[3] = 0.0  # a constant group
    w = Int4Weight.quantize(x)
    step = w.scale.repeat_interleave(GROUP, dim=1)
    assert bool(((w.dequantize() - x).abs() <= step / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="multiple of the group size"):
        Int4Weight.quantize(torch.randn(4, 40))


@pytest.mark.parametrize("rows", [1, 2, 5, 33])
def test_kernel_product_equals_the_dequantized_matrix(rows: int) -> None:
    torch.manual_seed(0)
    w = Int4Weight.quantize(torch.randn(96, 256))
    packed = Int4Packed.pack(w, torch.bfloat16)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed.matmul(x).float()  # [rows, 96]
        alone = packed.matmul(x, rows_alone=True)
    ref = x.float() @ w.dequantize().to(torch.bfloat16).float().t()
    assert got.shape == (rows, 96)
    assert float((got - ref).abs().max()) <= 0.02 * float(ref.abs().max())
    if rows_invariant(packed):  # measured on this machine; then one call per row changes nothing
        assert torch.equal(alone, packed.matmul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tiled_kernel_is_close_and_batch_invariant_by_construction(dtype: torch.dtype) -> None:
    """csrc/quantmm.h: the product of the 4-bit weights with float16 d and m (a GGUF block's own;
    to float32 rounding, or the bfloat16 output's), a row's bits
    the same alone as among 1-20 rows (one pass takes at most 8), NaN rows stay NaN, and
    torch's kernel on the same weights agrees within bfloat16 rounding."""
    from specdraft.model import fastpath

    if fastpath.quant_tiles(96, 256) is None:
        pytest.skip(f"quantmm.h does not run here (path: {fastpath.quant_path()})")
    gen = torch.Generator().manual_seed(5)
    w = Int4Weight.quantize(torch.randn(96, 256, generator=gen))
    tiled = Int4Packed.pack(w, torch.bfloat16)
    assert tiled.tiled and tiled.packed.shape == (6, 128, 16) and tiled.scales_zeros.shape == (6, 8, 2, 16)
    x = torch.randn(20, 256, generator=gen).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([tiled.matmul(x[i : i + 1]) for i in range(20)])  # [20, 96]
        for m in (1, 3, 8, 9, 17, 20):
            assert torch.equal(tiled.matmul(x[:m]), alone[:m]), m
        assert alone.dtype == dtype
        d, m = w.scale.double().half().double(), (w.zero.double() - 8 * w.scale.double()).half().double()
        exact = w.q.double() * d.repeat_interleave(GROUP, 1) + m.repeat_interleave(GROUP, 1)  # fp16 d and m, as GGUF's
        assert float((exact - w.dequantize().double()).abs().max()) <= 1e-3 * float(exact.abs().max())
        ref = x.double() @ exact.t()
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: the output's rounding
        assert float((alone.double() - ref).abs().max()) <= tol * float(ref.abs().max())
        nan = x[:2].clone()
        nan[1, 7] = float("nan")
        out = tiled.matmul(nan)
        assert bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
        if int4_kernel_available():
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2)
            sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
            theirs = Int4Packed(packed, sz, 96).matmul(x.bfloat16()).double()
            assert float((theirs - ref).abs().max()) <= 0.02 * float(ref.abs().max())
            assert float((alone.double() - theirs).abs().max()) <= 0.02 * float(ref.abs().max())


def test_a_q8_head_is_multiplied_as_stored(folder: Path) -> None:
    """In int4 mode a Q8_0 LM head (its own matrix, or the embedding where tied) runs as stored,
    8 bits with the blocks' own d (csrc/quantmm.h): its logits are the product with the file's
    dequantized values to the bfloat16 output's rounding."""
    from specdraft.model import fastpath
    from specdraft.model.load_gguf import HEAD_Q8

    path = write_gguf_model(folder.parent / "tiny-Q8_0.gguf", folder, qtype="Q8_0")
    _, weights, _ = load_gguf(path, int4=True)
    q8 = weights[HEAD_Q8]
    source = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # untied, or tied
    assert q8.q.dtype == torch.int8 and q8.shape == tuple(weights[source].shape)
    assert torch.equal(q8.dequantize(), load_gguf(path)[1][source])  # the same values as read
    if fastpath.quant_tiles(*q8.shape) is None:
        pytest.skip(f"quantmm.h does not run here (path: {fastpath.quant_path()})")
    head = load(path, dtype="int4").model.lm_head
    assert head.int4 is not None and head.int4.bits == 8
    h = torch.randn(5, q8.shape[1], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.inference_mode():
        got = head(h).double()  # [5, V]
    ref = h.double() @ q8.dequantize().double().t()
    assert float((got - ref).abs().max()) <= 8e-3 * float(ref.abs().max())


def test_int4_model_follows_the_q4_file(q4_file: Path) -> None:
    """``dtype="int4"`` computes the file's own 4-bit weights: its logits are as close to the
    float32 dequantization of the same file as a bfloat16 model is; a broken block reader
    or permutation gives errors of order 1."""
    tokens = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = _logits(load(q4_file, dtype="float32").model, tokens)
    bf16 = _logits(load(q4_file, dtype="bfloat16").model, tokens)
    int4 = load(q4_file, dtype="int4")
    assert int4.model.layers[0].wqkv.int4 is not None and int4.model.lm_head.int4 is not None  # stored 4-bit
    ours = _logits(int4.model, tokens)

    def rel(a: torch.Tensor) -> float:
        return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    assert rel(ours) <= max(3 * rel(bf16), 0.02)


def test_float_weights_are_quantized_on_request(folder: Path) -> None:
    """A Hugging Face folder in int4 mode: every layer matrix quantized (lossy), loosely close."""
    tokens = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = _logits(load(folder).model, tokens)
    int4 = load(folder, dtype="int4")
    assert all(lin.int4 is not None for lin in (int4.model.layers[1].w_down, int4.model.layers[1].wo))
    ours = _logits(int4.model, tokens)
    assert float((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 0.6


def test_wide_products_take_the_dense_path_and_stay_close(folder: Path) -> None:
    """A prompt chunk (``prompt=``) runs the dense copy of the same 4-bit values: its cache
    entries are close to those of one-token steps, not far off."""
    from specdraft.model.load_hf import load_hf

    config, weights = load_hf(folder)
    model = build_transformer(config, weights, dtype=torch.bfloat16, batch_invariant=True, int4=True)
    tokens = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    wide, steps = model.new_cache(1, 20), model.new_cache(1, 20)
    with torch.inference_mode():
        model(tokens, torch.arange(20)[None], wide, prompt=[20])
        for i in range(20):
            model(tokens[:, i : i + 1], torch.tensor([[i]]), steps)
    diff = (wide.k.float() - steps.k.float()).abs().max()
    assert 0 < float(diff) < 0.1 * float(steps.k.float().abs().max())
