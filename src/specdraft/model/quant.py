"""Quantized weights kept as stored: GGUF Q4_0 / Q4_1 layer matrices at 4 bits and (where
``csrc/quantmm.h`` runs) a Q8_0 LM head at 8 bits, multiplied by ``csrc/quantmm.h`` or, for
4 bits, PyTorch's CPU weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``).

A 4-bit weight is ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``q`` in 0..15
and one (scale, zero) pair per group of ``GROUP`` (32) inputs, ``g = k // GROUP``: torch's
kernel's layout. Q4_0 blocks (``d * (q - 8)``) map to ``scale = d, zero = 0``; Q4_1 blocks
(``d * q + m``) to ``scale = d, zero = m + 8 d``. An 8-bit one (``Q8Weight``) is ``q[n, k] *
d[n, g]``, ``q`` in -128..127.

Where the C++ extension runs with AVX-512, the products go through ``csrc/quantmm.h``: tiles
of 16 outputs with the blocks' own float16 d (and m), so a weight is the file's exactly;
batch-invariant by construction; bfloat16 rows in AVX-512 BF16 dot products. Measured on a
2-core AMD EPYC (Zen 5), the default model's 30 layers' 4-bit products take 4.0 ms at one row
(torch's kernel the same: both stream the weights from DRAM at ~16 GB/s) and 8.1 ms at eight
(torch's 12.4). The LM head (Q8_0 in the file) then streams 30 MB a step instead of the 57 MB
of its bfloat16 copy. ``fastpath.quant_path`` says which kernel runs.

Elsewhere torch's int4 kernel takes the scales in the activation dtype (bfloat16 here), so a
Q4_1 weight is the file's up to that rounding of d and m + 8d (not of every weight, as a
bfloat16 dequantization is), and the LM head stays a bfloat16 copy. Its result for a row does
not depend on how many rows share the call (checked for 1-200 rows, and measured once per
process: ``rows_invariant``).

Float weights (a Hugging Face folder, or a GGUF tensor in another format) can be quantized
to the 4-bit layout with ``Int4Weight.quantize`` (affine min/max per group): that one is lossy
against the float model and is said so where it is offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # inputs per (scale, zero) pair: GGUF's block size
_Q4_0_BYTES = 18  # fp16 d, 16 bytes of nibbles
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34  # fp16 d, 32 int8 values
INT4_FORMATS = ("Q4_0", "Q4_1")  # GGUF tensor types read without dequantizing
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A 4-bit matrix before packing for the kernel."""

    q: Tensor  # [N, K] uint8, values 0..15
    scale: Tensor  # [N, K / GROUP] float32
    zero: Tensor  # [N, K / GROUP] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> Tensor:
        """[N, K] float32."""
        s = self.scale.repeat_interleave(GROUP, dim=1)  # [N, K]
        z = self.zero.repeat_interleave(GROUP, dim=1)  # [N, K]
        return (self.q.float() - 8) * s + z

    def rows(self, index: Tensor) -> "Int4Weight":
        """The rows in ``index`` order (llama.cpp's Q/K permutation is a row permutation)."""
        return Int4Weight(self.q[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Stack along the output rows (fused q/k/v and gate/up)."""
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))

    @classmethod
    def quantize(cls, w: Tensor) -> "Int4Weight":
        """Affine 4-bit quantization of a float matrix [N, K] (K a multiple of GROUP), per group
        of GROUP inputs: the group's min and max map to 0 and 15 (lossy)."""
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4: {k} inputs is not a multiple of the group size {GROUP}")
        g = w.detach().float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, G]
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo + 8 * scale)

    @classmethod
    def from_gguf_blocks(cls, data: np.ndarray, kind: str, shape: tuple[int, int]) -> "Int4Weight":
        """Q4_0 / Q4_1 block bytes ([N, K / 32 * block bytes] uint8) -> an Int4Weight [N, K].
        A block's 16 bytes hold elements 0-15 in their low nibbles and 16-31 in the high ones."""
        n, k = shape
        size = _Q4_0_BYTES if kind == "Q4_0" else _Q4_1_BYTES
        blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // GROUP, size)  # [N, G, bytes]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
        nib = blocks[..., size - 16 :]  # [N, G, 16]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)  # [N, K]
        scale = torch.from_numpy(d)
        if kind == "Q4_0":
            zero = torch.zeros_like(scale)
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
            zero = torch.from_numpy(m) + 8 * scale
        return cls(torch.from_numpy(q.astype(np.uint8)), scale, zero)


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """An 8-bit matrix (GGUF Q8_0): ``w[n, k] = q[n, k] * d[n, k // GROUP]``."""

    q: Tensor  # [N, K] int8
    d: Tensor  # [N, K / GROUP] float32 (the blocks' float16 values)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> Tensor:
        """[N, K] float32."""
        return self.q.float() * self.d.repeat_interleave(GROUP, dim=1)

    @classmethod
    def from_gguf_blocks(cls, data: np.ndarray, shape: tuple[int, int]) -> "Q8Weight":
        """Q8_0 block bytes ([N, K / 32 * 34] uint8) -> a Q8Weight [N, K]."""
        n, k = shape
        blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // GROUP, _Q8_0_BYTES)  # [N, G, 34]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)  # [N, K]
        return cls(torch.from_numpy(q), torch.from_numpy(d))


@dataclass(frozen=True, slots=True)
class Int4Packed:
    """Quantized weights packed for a CPU kernel: ``csrc/quantmm.h``'s tiles where it runs (4 or
    8 bits, float16 parameters), else (4 bits only) torch's kernel (scales in the activation dtype)."""

    packed: Tensor  # tiled: [N / 16, K / 2, 16] uint8 (8 bits: [N / 16, K / 2, 2, 16] int8); else torch's layout (uint8)
    scales_zeros: Tensor  # tiled: [N / 16, K / GROUP, P, 16] float16 (P = 2: d, m; 8 bits: 1, d); else [K / GROUP, N, 2]
    out_features: int
    tiled: bool = False
    bits: int = 4

    @classmethod
    def pack(cls, w: Int4Weight, dtype: torch.dtype) -> "Int4Packed":
        from specdraft.model import fastpath  # here: fastpath imports this module through linear.py

        ext = fastpath.quant_tiles(*w.shape)
        if ext is not None:
            tiles, params = ext.quant_pack4(w.q, w.scale, w.zero)
            return cls(tiles, params, w.shape[0], tiled=True)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2)
        sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(dtype).contiguous()  # [G, N, 2]
        return cls(packed, sz, w.shape[0])

    @classmethod
    def pack8(cls, w: Q8Weight) -> "Int4Packed | None":
        """The 8-bit tiles of ``w``, or None where ``csrc/quantmm.h`` does not run (torch has no
        such kernel: the caller keeps its dense copy)."""
        from specdraft.model import fastpath

        ext = fastpath.quant_tiles(*w.shape)
        if ext is None:
            return None
        tiles, params = ext.quant_pack8(w.q, w.d)
        return cls(tiles, params, w.shape[0], tiled=True, bits=8)

    def matmul(self, x: Tensor, rows_alone: bool = False) -> Tensor:
        """x: [..., K] in the scales' dtype -> [..., N]. rows_alone: one kernel call per row (for
        a batch-invariant model on a machine where the kernel's rows depend on their batch)."""
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        if rows_alone and flat.shape[0] > 1:
            out = torch.cat([self._mm(flat[i : i + 1]) for i in range(flat.shape[0])])  # [M, N]
        else:
            out = self._mm(flat)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def _mm(self, flat: Tensor) -> Tensor:  # [M, K] -> [M, N]
        if self.tiled:
            from specdraft.model import fastpath

            return fastpath.extension().quant_mm(flat, self.packed, self.scales_zeros)
        return _INT4_MM(flat, self.packed, GROUP, self.scales_zeros)

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 2 if self.tiled else int(self.scales_zeros.shape[0]) * GROUP

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()


_ROWS_INVARIANT: dict[tuple[int, int, bool, int], bool] = {}
_CHECKED_ROW_COUNTS = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128)


def rows_invariant(packed: Int4Packed) -> bool:
    """Whether the kernel gives a row the same bits whatever the number of rows in the call,
    measured once per process for each (N, K, dtype, threads) on random inputs: true on the
    machines measured so far, but a kernel may pick another code path for larger row counts
    on another CPU, and a batch-invariant model must not trust it blindly."""
    k = packed.in_features
    key = (packed.out_features, k, packed.tiled, torch.get_num_threads())
    if key not in _ROWS_INVARIANT:
        gen = torch.Generator().manual_seed(0)
        dtype = torch.bfloat16 if packed.tiled else packed.scales_zeros.dtype  # the activations' dtype
        x = torch.randn(max(_CHECKED_ROW_COUNTS), k, generator=gen).to(dtype)  # [M, K]
        with torch.inference_mode():
            alone = torch.cat([packed._mm(x[i : i + 1]) for i in range(x.shape[0])])  # [M, N]
            _ROWS_INVARIANT[key] = all(torch.equal(packed._mm(x[:m]), alone[:m]) for m in _CHECKED_ROW_COUNTS)
    return _ROWS_INVARIANT[key]
