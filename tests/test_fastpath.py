"""The C++ layer loop (``fastpath.py``) computes exactly what the Python loop computes, in
every numeric mode, for every shape of forward it takes; what it does not take runs in Python."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdraft.model import fastpath
from specdraft.model.load_hf import load_hf
from specdraft.model.loader import build_transformer
from specdraft.model.transformer import Packing, Transformer
from tiny_models import write_hf_model

MODES = ["float32", "bfloat16", "bfloat16-bi", "int4", "int4-bi"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("fast") / "tiny", "llama", seed=3, hidden=128, heads=4, kv_heads=2,
                          intermediate=256, layers=3, max_position=512)


@pytest.fixture(scope="module", params=MODES)
def model(request: pytest.FixtureRequest, folder: Path) -> Transformer:
    config, weights = load_hf(folder)
    dtype, invariant = request.param.removesuffix("-bi"), request.param.endswith("-bi")
    m = build_transformer(config, weights, dtype=torch.float32 if dtype == "float32" else torch.bfloat16,
                          batch_invariant=invariant, int4=dtype == "int4")
    if fastpath.layers_for(m) is None:
        pytest.skip(f"the C++ layer loop is unavailable here ({fastpath._state['failed']})")
    return m


def _both(model: Transformer, cache_rows: int, run) -> list[list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Run ``run(cache)`` from the same starting cache with the C++ loop and with Python; return
    each run's tensors (outputs and the cache)."""
    v = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results = []
    for fast in (True, False):
        model.fast_path = fast
        cache = model.new_cache(cache_rows, 128)
        prefix = torch.randint(3, v, (cache_rows, 40), generator=gen)
        with torch.inference_mode():
            model(prefix, torch.arange(40).expand(cache_rows, 40), cache, prompt=[40] * cache_rows)
            results.append(run(cache) + [cache.k[:, :, :, :60].clone(), cache.v[:, :, :, :60].clone()])
        gen.manual_seed(0)
    model.fast_path = True
    return results


def _same(results: list[list[torch.Tensor]]) -> None:
    fast, slow = results
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), f"tensor {i} differs: max {float((a.float() - b.float()).abs().max())}"


def test_one_token_steps(model: Transformer) -> None:
    def run(cache):  # type: ignore[no-untyped-def]
        outs = []
        for i in range(4):
            out = model(torch.tensor([[5 + i]]), torch.tensor([[40 + i]]), cache, return_hidden=(1, 3))
            outs += [out.logits, out.hidden[1], out.hidden[3]]
        return outs
    _same(_both(model, 1, run))


def test_chains_and_ragged_batches(model: Transformer) -> None:
    def run(cache):  # type: ignore[no-untyped-def]
        cache.truncate([40, 33, 37])
        tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
        positions = torch.tensor([[40], [33], [37]]) + torch.arange(5)
        out = model(tokens, positions, cache, return_hidden=(2,))
        cache.truncate([42, 35, 38])
        step = model(torch.tensor([[1], [2], [3]]), torch.tensor([[42], [35], [38]]), cache)
        return [out.logits, out.hidden[2], step.logits]
    _same(_both(model, 3, run))


def test_layer_subsets_and_taps(model: Transformer) -> None:
    def run(cache):  # type: ignore[no-untyped-def]
        early = model(torch.tensor([[7, 8]]), torch.tensor([[40, 41]]), cache, num_layers=2, return_hidden=(0, 2))
        cache.truncate(40)
        skip = model(torch.tensor([[7]]), torch.tensor([[40]]), cache, layers=(0, 2), return_hidden=(1, 3))
        return [early.logits, early.hidden[0], early.hidden[2], skip.logits, skip.hidden[1], skip.hidden[3]]
    _same(_both(model, 1, run))


def test_tree_masks_agree(model: Transformer) -> None:
    """A tree (non-batch-invariant: one masked attention call; batch-invariant: a plan of key
    indices per node, gathered) gives the same bits from C++ as from Python, in a ragged
    batch too."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]

    def run(cache):  # type: ignore[no-untyped-def]
        out = model(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[40, 41, 41, 42]]), cache, mask=mask)
        return [out.logits]
    _same(_both(model, 1, run))

    def ragged(cache):  # type: ignore[no-untyped-def]
        cache.truncate([40, 36])
        out = model(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), torch.tensor([[40, 41, 41, 42], [36, 37, 37, 38]]),
                    cache, mask=mask.expand(2, 4, 4))
        return [out.logits]
    _same(_both(model, 2, ragged))


@pytest.mark.parametrize("real", [[5, 1, 1, 0], [5, 2, 3, 1]], ids=["split", "padded"])
def test_a_packed_forward_computes_the_real_tokens_alone(request: pytest.FixtureRequest, model: Transformer,
                                                         real: list[int]) -> None:
    """A forward told which tokens are real (``real``: a verification step's shorter drafts, an
    idle row) gives its real tokens what the padded forward gives them: the same bits in a
    batch-invariant mode, within rounding in the others (their products' rounding may follow
    the row count, and where one row in four drafted, attention is split); the padding's
    outputs and cached keys and values are zero; the C++ and the Python loops agree bit for
    bit. Row 0 is a tree, rows 1-3 chains cut short (a row with 0 tokens: idle)."""
    starts = [40, 33, 37, 35]
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
                        dtype=torch.bool)
    chain = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = torch.stack([tree, chain, chain, chain])  # [4, 5, 5]
    tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])
    positions = torch.tensor(starts)[:, None] + torch.tensor([[0, 1, 1, 2, 3]] + [[0, 1, 2, 3, 4]] * 3)
    packing = Packing.of(real, 5, torch.device("cpu"))
    assert packing is not None and (packing.deep is not None) == (real == [5, 1, 1, 0])

    def run(packed: bool):  # type: ignore[no-untyped-def]
        def go(cache):  # type: ignore[no-untyped-def]
            cache.truncate(starts)
            out = model(tokens, positions, cache, mask=mask, return_hidden=(0, 2), real=real if packed else None)
            return [out.logits, out.hidden[0], out.hidden[2], out.last_hidden]
        return go

    packed = _both(model, 4, run(True))
    _same(packed)
    padded = _both(model, 4, run(False))[0]
    exact = request.node.callspec.params["model"].endswith("-bi")
    for i, (a, b) in enumerate(zip(packed[0], padded)):
        if i >= 4:  # the cache [L, B, Hkv, 60, D]: each row's real positions
            a = torch.cat([a[:, r, :, n : n + k] for r, (n, k) in enumerate(zip(starts, real))], dim=2)
            b = torch.cat([b[:, r, :, n : n + k] for r, (n, k) in enumerate(zip(starts, real))], dim=2)
            zero = all(not packed[0][i][:, r, :, n + k : n + 5].any() for r, (n, k) in enumerate(zip(starts, real)))
        else:  # [B, T, ...]: the real tokens, then the padding
            zero = all(not a[r, k:].any() for r, k in enumerate(real))
            a = torch.cat([a[r, :k] for r, k in enumerate(real)])
            b = torch.cat([b[r, :k] for r, k in enumerate(real)])
        assert zero, f"tensor {i}: the padding is not zero"
        if exact:
            assert torch.equal(a, b), f"tensor {i} differs from the padded forward"
        else:
            scale = float(b.float().abs().max())
            assert float((a.float() - b.float()).abs().max()) <= 0.03 * scale, f"tensor {i} is far from the padded forward"


def test_off_switch(monkeypatch: pytest.MonkeyPatch, model: Transformer) -> None:
    monkeypatch.setenv("SPECDRAFT_FASTPATH", "0")
    assert fastpath.layers_for(model) is None
    monkeypatch.delenv("SPECDRAFT_FASTPATH")
    assert fastpath.layers_for(model) is not None


def test_a_cast_model_is_captured_again(folder: Path) -> None:
    config, weights = load_hf(folder)
    m = build_transformer(config, weights)
    first = fastpath.layers_for(m)
    if first is None:
        pytest.skip("the C++ layer loop is unavailable here")
    assert fastpath.layers_for(m) is first
    m.to(torch.bfloat16).pack_weights()
    assert fastpath.layers_for(m) is not first


def test_without_a_compiler_the_python_loop_runs_after_one_warning(folder: Path, tmp_path: Path) -> None:
    """A machine where the extension cannot be built (here: no compiler) gets one warning line
    and the same outputs from the Python loop."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from specdraft.model.load_hf import load_hf\n"
        "from specdraft.model.loader import build_transformer\n"
        f"config, weights = load_hf(__import__('pathlib').Path({str(folder)!r}))\n"
        "m = build_transformer(config, weights)\n"
        "with torch.inference_mode():\n"
        "    for _ in range(3):\n"
        "        out = m(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), m.new_cache(1, 8))\n"
        "print(int(out.logits.argmax()))\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(tmp_path / "no-such-compiler")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "C++ decode loop unavailable" in line]
    assert len(warnings) == 1, proc.stderr[-2000:]
    config, weights = load_hf(folder)
    m = build_transformer(config, weights)
    m.fast_path = False
    with torch.inference_mode():
        want = m(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), m.new_cache(1, 8)).logits
    assert int(proc.stdout.split()[-1]) == int(want.argmax())
