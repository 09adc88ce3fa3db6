"""Linear layers with an optional oneDNN-packed copy of the weight for CPU inference.

On the CPU, PyTorch's default float32 matrix product is slow for the row counts that
decoding and verification produce: on a 2-core AMD EPYC (Zen 5) a float32 forward of the
default model over 1 token costs 58 ms on the default path and 36 ms with oneDNN and a
pre-packed (blocked) weight; over 9 tokens the default path costs about 2x more than packed.
(On an Intel Xeon the default path was ~10% faster for 1-3 rows, which an earlier rule used;
the Zen 5 numbers decided for one rule everywhere.) In bfloat16 the packed path is faster for
every row count and bit-identical to the default one (measured). So, on the CPU, every
product takes the packed path (``PACKED_FROM_ROWS`` = 1).

(The packed path with 2-3 rows differs from its 1-row result by ~1e-4 in float32: it is not
bitwise batch-invariant, see below.)

A batch-invariant model packs with ``single_rows=True``: one row then takes the packed path
too, so that a row's result never depends on how many rows share the product. oneDNN's packed
kernels give a row the same bits for every row count from 2 up (measured up to 256 rows on an
Intel Xeon and an AMD EPYC), and on the Xeon for one row too; on the EPYC (Zen 5) a one-row
bfloat16 product with 1,536 inputs takes another kernel and differs in ~9% of rows. So a
batch-invariant model computes a one-row product as a two-row one (the row twice, first row
kept): every product then takes the multi-row kernels.

oneDNN packs bfloat16 (float16) weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
(AVX-512-FP16); ``packable`` asks it once per dtype. Elsewhere (an AVX2-only AMD EPYC, measured)
torch's default bfloat16 product costs each row the same (a 576 x 3072 weight: 0.67 ms for 2 rows,
5.3 ms for 16, 118 ms for 512), 4-6x packed float32's from 4 rows on: prefill ran 6x slower than
in float32 and a 9-token verification cost ~9 one-token steps. There the packed copy is a
*widened* one, of the weight in float32 (twice the bfloat16 weight's memory): a product casts its
rows to float32, takes the packed float32 kernel and rounds the result back (the products of
bfloat16 values are exact in float32 and the sums accumulate in float32, as oneDNN's bfloat16
kernels do). It serves products of ``WIDENED_FROM_ROWS`` rows or more (fewer take torch's
default bfloat16 path, faster for 1-3 rows); a batch-invariant model takes it for every row
count, one row as two, so that a row's bits never depend on the product's size.

The packed copy costs the weight's memory again; ``pack()`` is opt-out (``pack_weights=False``
when loading). Training and autograd always use the plain weight. A weight changed after
packing (in place or replaced) is repacked on the next call; deep copies repack themselves.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.model.quant import Int4Packed, rows_invariant


PACKED_FROM_ROWS = 1  # float32: the fewest rows (tokens in the product) that take the packed path
WIDENED_FROM_ROWS = 4  # a widened copy (module doc): the fewest rows that take it (not batch-invariant)


def onednn_available() -> bool:
    return bool(getattr(torch.backends, "mkldnn", None) and torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


_packable: dict[torch.dtype, bool] = {}


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU packs linear weights of ``dtype`` (asked once per dtype)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or not onednn_available():
        return False
    if dtype not in _packable:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
            _packable[dtype] = True
        except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
            _packable[dtype] = False
    return _packable[dtype]


class Linear(nn.Linear):
    """nn.Linear whose inference forward may use a packed weight (see module doc)."""

    packed: Tensor | None
    _packed_key: tuple[int, int, torch.dtype] | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = None
        self._packed_key = None
        self.single_rows = False  # use the packed path for one row too (batch-invariant models)
        self.widened = False  # the packed copy is a float32 one of a lower-precision weight (module doc)
        self.int4: Int4Packed | None = None  # 4-bit weights (quant.py); ``weight`` then holds their dequantized values
        self.int4_rows_alone = False  # one int4 call per row (batch-invariant, where the kernel is not)

    def _weight_key(self) -> tuple[int, int, torch.dtype]:
        return (self.weight.data_ptr(), self.weight._version, self.weight.dtype)

    def pack(self, single_rows: bool = False) -> None:
        """Make the packed copy (CPU only; a no-op where oneDNN is missing or cannot pack this
        dtype on this CPU). With 4-bit weights the packed copy (of their dequantized values)
        serves wide products only."""
        self.single_rows = single_rows
        if self.int4 is not None:
            self.int4_rows_alone = single_rows and not rows_invariant(self.int4)
        dtype = self.weight.dtype
        widen = dtype in (torch.bfloat16, torch.float16) and not packable(dtype) and packable(torch.float32)
        if self.weight.device.type != "cpu" or not (packable(dtype) or widen):
            self.unpack()
            return
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float() if widen else weight, None)
        self.widened = widen
        self._packed_key = self._weight_key()

    def unpack(self) -> None:
        self.packed = None
        self.widened = False
        self._packed_key = None

    @property
    def packed_from_rows(self) -> int:
        """The fewest rows (tokens in a product) that take the packed copy."""
        if self.single_rows:
            return 1
        return WIDENED_FROM_ROWS if self.widened else PACKED_FROM_ROWS

    def __deepcopy__(self, memo: dict[int, object]) -> "Linear":
        clone = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        memo[id(self)] = clone
        clone.weight = copy.deepcopy(self.weight, memo)
        clone.bias = copy.deepcopy(self.bias, memo)
        clone.train(self.training)
        clone.int4 = self.int4  # immutable: shared
        clone.int4_rows_alone = self.int4_rows_alone
        if self.packed is not None:
            clone.pack(self.single_rows)
        return clone

    def forward(self, x: Tensor, wide: bool = False) -> Tensor:  # x: [..., in] -> [..., out]
        """wide: a product with many rows (a prompt chunk), where the 4-bit kernel is slower
        than the dense packed one (quant.py); ignored without 4-bit weights."""
        int4 = self.int4
        if int4 is not None and not wide and x.is_cpu and not torch.is_grad_enabled():
            out = int4.matmul(x, self.int4_rows_alone)  # [..., out]
            return out if self.bias is None else out + self.bias
        packed = self._packed_for(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        rows, bias = x, self.bias
        if self.widened:
            rows, bias = x.float(), None if bias is None else bias.float()
        if self.single_rows and x.numel() == x.shape[-1]:  # one row: as two (module doc)
            twice = rows.reshape(1, x.shape[-1]).repeat(2, 1)  # [2, in]
            out = torch.ops.mkldnn._linear_pointwise(twice, packed, bias, "none", [], "")[:1]
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out.to(x.dtype) if self.widened else out

    def _packed_for(self, x: Tensor) -> Tensor | None:
        """The packed weight for this product (repacked first if the weight changed), or None:
        the default path (training, too few float32 rows, or a dtype this CPU cannot pack)."""
        if self.packed is None or torch.is_grad_enabled():
            return None
        if self._packed_key != self._weight_key():
            self.pack(self.single_rows)  # a cast may widen the copy, or drop it
        return self.packed if self.packed is not None and self._use_packed(x) else None

    def _use_packed(self, x: Tensor) -> bool:
        if x.dtype != torch.float32 and not self.widened:
            return True
        return x.numel() // x.shape[-1] >= self.packed_from_rows
