"""The batch-invariant attention kernel (``csrc/attend.h`` through ``fastpath.attend``): close
to SDPA, and a query's bits depend on its own visible keys alone (not on its batch mates, the
cache's capacity, or whether its keys came as a count or as gathered indices)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.model import fastpath

pytestmark = pytest.mark.skipif(fastpath.extension() is None, reason="the C++ extension is unavailable here")

HKV, G, D = 3, 3, 64  # the default model's attention shape


def _qkv(dtype: torch.dtype, rows: int, capacity: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HKV, G, D, generator=gen).to(dtype)  # [Q, Hkv, G, D]
    k = torch.randn(rows, HKV, capacity, D, generator=gen).to(dtype)  # [B, Hkv, S, D]
    v = torch.randn(rows, HKV, capacity, D, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_close_to_sdpa(dtype: torch.dtype, tol: float) -> None:
    counts = [1, 5, 15, 16, 17, 64, 200, 333]
    q, k, v = _qkv(dtype, len(counts), 400)
    with torch.inference_mode():
        out = fastpath.attend(q, k, v, list(range(len(counts))), counts, [])  # [Q, Hkv, G, D]
        assert out is not None and out.dtype == dtype and out.shape == q.shape
        for i, n in enumerate(counts):
            ref = F.scaled_dot_product_attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
            err = float((out[i].float() - ref[0].float()).abs().max())
            assert err <= tol, f"{n} keys: {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_alone_batched_and_from_gathered_keys(dtype: torch.dtype) -> None:
    counts = [7, 300, 31, 129, 64, 2, 250, 90]
    q, k, v = _qkv(dtype, len(counts), 320, seed=1)
    with torch.inference_mode():
        together = fastpath.attend(q, k, v, list(range(8)), counts, [])
        for i, n in enumerate(counts):
            alone = fastpath.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], [0], [n], [])  # a one-row cache
            assert torch.equal(alone[0], together[i]), f"row {i}"
            wider = torch.cat([k[i : i + 1], k[i : i + 1]], 2), torch.cat([v[i : i + 1], v[i : i + 1]], 2)
            assert torch.equal(fastpath.attend(q[i : i + 1], *wider, [0], [n], [])[0], together[i])  # capacity
        # a tree node: its visible keys gathered (every other key) = the same keys laid out in order
        idx = torch.arange(0, 300, 2)
        gathered = fastpath.attend(q[1:2], k, v, [1], [-1], [idx])
        packed_k, packed_v = k[1:2, :, idx].contiguous(), v[1:2, :, idx].contiguous()
        assert torch.equal(gathered, fastpath.attend(q[1:2], packed_k, packed_v, [0], [len(idx)], []))
        shifted = torch.cat([q[1:2]] * 3)  # the same query three times, among a count and picks
        mixed = fastpath.attend(shifted, k, v, [1, 1, 1], [-1, 300, -1], [idx, torch.arange(300)])
        assert torch.equal(mixed[0], gathered[0]) and torch.equal(mixed[1], together[1])
        assert torch.equal(mixed[2], together[1])
        assert not torch.equal(together[0], together[2])  # different rows: different outputs


def test_shapes_it_does_not_cover_fall_back() -> None:
    q = torch.randn(1, 2, 2, 24)  # head dim 24: not a multiple of 16
    k = v = torch.randn(1, 2, 10, 24)
    assert fastpath.attend(q, k, v, [0], [10], []) is None
    assert fastpath.attend(q.half(), k.half(), v.half(), [0], [10], []) is None  # float16: not covered
    assert fastpath.attend_applies(64, 3, torch.bfloat16, torch.device("cpu"))
