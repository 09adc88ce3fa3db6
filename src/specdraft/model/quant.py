"""4-bit weights kept at 4 bits: GGUF Q4_0 / Q4_1 blocks read as they are, multiplied by
``csrc/int4mm.h`` or PyTorch's CPU weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``).

A weight is ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``q`` in 0..15 and
one (scale, zero) pair per group of ``GROUP`` (32) inputs, ``g = k // GROUP``: exactly the
kernel's layout. Q4_0 blocks (``d * (q - 8)``) map to ``scale = d, zero = 0``; Q4_1 blocks
(``d * q + m``) to ``scale = d, zero = m + 8 d``. The kernel takes its scales in the
activation dtype (bfloat16 here), so a Q4_1 weight is the file's up to that rounding of d and
m + 8d (not of every weight, as a bfloat16 dequantization is).

Float weights (a Hugging Face folder, or a GGUF tensor in another format) can be quantized
to the same layout with ``Int4Weight.quantize`` (affine min/max per group): that one is lossy
against the float model and is said so where it is offered.

Where the C++ extension runs with AVX-512, the products go through ``csrc/int4mm.h`` instead
(tiles of 16 outputs, float32 scales and zeros, so a Q4_1 weight is the file's up to float32
rounding; batch-invariant by construction; bfloat16 rows in AVX-512 BF16 dot products): on the
same machine one layer's four products take 0.10 ms at one row (torch's kernel 0.13) and 0.19
ms at eight (0.38). ``fastpath.int4_path`` says which runs.

Torch's kernel, measured on a 2-core AMD EPYC (Zen 5), the default model's 120 layer products per token:
4.4 ms at one token against 14 ms for oneDNN's packed bfloat16 (the products stream 4x fewer
bytes), but 12.6 ms at 8 tokens and 46 ms at 32 (bfloat16 packed: 16 and 19 ms): the kernel is
a matrix-vector one. Its result for a row does not depend on how many rows share the call
(checked for 1-200 rows), so a batch-invariant model can use it for every row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # inputs per (scale, zero) pair: GGUF's block size
_Q4_0_BYTES = 18  # fp16 d, 16 bytes of nibbles
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
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
class Int4Packed:
    """An Int4Weight packed for a CPU kernel: ``csrc/int4mm.h``'s tiles where it runs (float32
    scales and zeros), else torch's kernel (scales in the activation dtype)."""

    packed: Tensor  # tiled: [N / 16, K / 2, 16] uint8; else torch's kernel's own layout (uint8)
    scales_zeros: Tensor  # tiled: [N / 16, K / GROUP, 2, 16] float32; else [K / GROUP, N, 2] in the activation dtype
    out_features: int
    tiled: bool = False

    @classmethod
    def pack(cls, w: Int4Weight, dtype: torch.dtype) -> "Int4Packed":
        from specdraft.model import fastpath  # here: fastpath imports this module through linear.py

        ext = fastpath.int4_tiles(*w.shape)
        if ext is not None:
            tiles, pairs = ext.int4_pack(w.q, w.scale, w.zero)
            return cls(tiles, pairs, w.shape[0], tiled=True)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2)
        sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(dtype).contiguous()  # [G, N, 2]
        return cls(packed, sz, w.shape[0])

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

            return fastpath.extension().int4_mm(flat, self.packed, self.scales_zeros)
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
