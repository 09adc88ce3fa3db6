"""The decoder layers' loop in C++ (``csrc/decode.cpp``), for CPU inference.

A 4-bit decode step of the default model makes about 1,300 small ATen calls; on a 2-core CPU
the Python between them costs about a third of the step (measured: the 30 layers take 10.2 ms
from Python, 6.6 ms from C++). ``decode.cpp`` makes exactly the calls ``Block.forward`` makes,
in the same order on the same shapes, so its results are bit for bit those of the Python loop
(the tests check it in every numeric mode): it is not another numeric mode, only the same one
without the interpreter. The Python loop stays the reference, the path for what the C++ one
does not cover (prompt chunks, tree plans in batch-invariant models, autograd, other
devices), and the fallback where the extension cannot be built.

The extension is compiled with torch's own tool chain on first use (about 30 s, a C++
compiler needed) and cached by torch under ``~/.cache/torch_extensions``; a failed or
unavailable build prints one warning line and the Python loop runs. ``SPECDRAFT_FASTPATH=0``
turns it off (for debugging).

The same extension runs a feature head's draft step (``HeadLayer``: an EAGLE-3 or MTP layer
with fused products, ``head_layer``): drafts decide no output token, so that path is not
bit-identical to the head's Python layer, only equal within rounding (tests check it).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from specdraft.model.linear import PACKED_FROM_ROWS, Linear

if TYPE_CHECKING:
    from specdraft.model.transformer import Transformer

SOURCE = Path(__file__).with_name("csrc") / "decode.cpp"
_state: dict[str, Any] = {"module": None, "failed": None, "seconds": None, "compiled": None}
# model -> (weights key, its C++ layers or None where they do not apply)
_layers: "weakref.WeakKeyDictionary[Transformer, tuple[tuple[Any, ...], Any]]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return os.environ.get("SPECDRAFT_FASTPATH", "1").lower() not in ("0", "off", "no", "false")


def extension() -> Any | None:
    """The compiled module, building it on first use; None where it cannot be built."""
    if _state["module"] is not None or _state["failed"] is not None:
        return _state["module"]
    try:
        from torch.utils.cpp_extension import load

        flags = _cflags()
        sources = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h"))
        digest = hashlib.sha256(sources + torch.__version__.encode() + " ".join(flags).encode()
                                + _cpu_identity().encode()).hexdigest()[:12]
        name = f"specdraft_decode_{digest}"
        build = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
        compiled = not any(build.glob(f"{name}/{name}*.so")) and not any(build.glob(f"*/{name}/{name}*.so"))
        if compiled:
            print("specdraft: building the C++ decode loop (first use only, about 30 s)...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        _state["module"] = load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=_openmp(),
                                verbose=False)
        _state.update(seconds=time.perf_counter() - t0, compiled=compiled)
    except Exception as e:  # no compiler, no headers, a torch without the tool chain: run Python
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        _state["failed"] = reason
        print(f"specdraft: warning: C++ decode loop unavailable ({reason[:160]}); using the Python loop",
              file=sys.stderr, flush=True)
    return _state["module"]


def _cflags() -> list[str]:
    """-march=native on x86-64: attend.h's 16-lane vectors then map to the machine's registers
    (on the SSE2 baseline its attention is 6x slower) and quantmm.h has AVX-512 where the CPU
    does. The build is cached per CPU (the digest includes ``_cpu_identity``). -fopenmp where
    torch runs on OpenMP: at::parallel_for is inline there, and without it runs on one thread."""
    native = platform.machine().lower() in ("x86_64", "amd64")
    return (["-O2", "-march=native"] if native else ["-O2"]) + _openmp()


def _openmp() -> list[str]:
    """-fopenmp where torch's own thread pool is OpenMP (its libgomp is then the one linked)."""
    return ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux") else []


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), so that a -march=native build is not reused on
    another kind of CPU sharing the same cache folder."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def attend(q: Tensor, k: Tensor, v: Tensor, rows: list[int], counts: list[int], picks: list[Tensor]) -> Tensor | None:
    """Batch-invariant attention (``csrc/attend.h``): q [Q, Hkv, G, D], k, v [B, Hkv, S, D]; per
    query its cache row and key count (-1: the next of ``picks``, index tensors). Returns
    [Q, Hkv, G, D], or None where the kernel does not apply (no extension, not the CPU, or a
    shape or dtype it does not cover): the caller then attends with SDPA. The C++ layer loop
    makes the same choice, so both loops give the same bits; ``SPECDRAFT_FASTPATH=0`` does not
    change it (it is numerics, not the loop)."""
    if not attend_applies(q.shape[-1], q.shape[-2], q.dtype, q.device):
        return None
    return _state["module"].attend(q, k, v, rows, counts, picks)


def attend_applies(head_dim: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether batch-invariant attention runs through ``csrc/attend.h`` for these shapes."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or extension() is None:
        return False
    return bool(_state["module"].attend_supports(head_dim, group))


def quant_tiles(out_features: int, in_features: int) -> Any | None:
    """The extension where ``csrc/quantmm.h`` multiplies [out, in] 4- or 8-bit weights here
    (the CPU with AVX-512), else None (torch's int4 kernel then, and a bfloat16 LM head)."""
    ext = extension()
    return ext if ext is not None and ext.quant_supports(out_features, in_features) else None


def quant_path() -> str:
    """How quantized products run here: "dot" or "fma" (``csrc/quantmm.h``'s bfloat16 pass),
    or "torch" (torch's int4 kernel: no extension, or no AVX-512)."""
    ext = extension()
    path = ext.quant_path() if ext is not None else "none"
    return "torch" if path == "none" else path


def status() -> dict[str, Any]:
    """Whether the extension is in use, and how long building or loading it took."""
    extension()
    return {"available": _state["module"] is not None, "failed": _state["failed"], "seconds": _state["seconds"],
            "compiled": _state["compiled"], "enabled": enabled()}


def _linear_parts(lin: Linear) -> list[Tensor | None]:
    int4 = lin.int4
    return [None if int4 is None else int4.packed, None if int4 is None else int4.scales_zeros, lin.packed,
            lin.weight, lin.bias]


def _rules(lins: "list[Linear] | tuple[Linear, ...]") -> tuple[list[int], list[bool], list[bool], list[int]]:
    """decode.cpp's LinearRules: each linear's output width, single_rows, widened, packed_from_rows."""
    return ([lin.out_features for lin in lins], [lin.single_rows for lin in lins], [lin.widened for lin in lins],
            [lin.packed_from_rows for lin in lins])


def _linears(model: "Transformer") -> list[Linear]:
    return [lin for b in model.layers for lin in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]


def _key(model: "Transformer") -> tuple[Any, ...]:
    """Changes when the model's weights are moved or cast (``.to`` swaps every parameter's
    storage): checked on every forward, so it must cost nothing."""
    first, last = model.layers[0].wqkv.weight, model.layers[-1].w_down.weight
    return (first.data_ptr(), last.data_ptr(), first.dtype)


def layers_for(model: "Transformer") -> Any | None:
    """The C++ layers of ``model``, or None where the C++ loop does not apply. Captured on first
    use: weights changed in place afterwards need ``model.pack_weights()`` (which drops the
    capture), as they need it for the packed copies."""
    if not enabled() or model.device.type != "cpu":
        return None
    key = _key(model)
    cached = _layers.get(model)
    if cached is None or cached[0] != key:
        cached = (key, _build(model))
        _layers[model] = cached
    return cached[1]


def drop(model: "Transformer") -> None:
    """Forget the C++ capture of ``model`` (its weights or packing changed)."""
    _layers.pop(model, None)


def _build(model: "Transformer") -> Any | None:
    linears = _linears(model)
    if PACKED_FROM_ROWS != 1 or any(lin.int4_rows_alone for lin in linears):
        return None  # float32 products on the default path / one int4 call per row: not in decode.cpp
    ext = extension()
    if ext is None:
        return None
    for lin in linears:  # a weight changed since packing is repacked first, as Linear.forward would
        if lin.packed is not None and lin._packed_key != lin._weight_key():
            lin.pack(lin.single_rows)
    c = model.config
    layers = ext.Layers(c.num_heads, c.num_kv_heads, c.head_dim)
    for block in model.layers:
        lins = (block.wqkv, block.wo, block.w_gate_up, block.w_down)
        tensors = [t for lin in lins for t in _linear_parts(lin)]
        layers.add_layer(block.attn_norm.weight, block.ffn_norm.weight, block.attn_norm.eps, tensors,
                         *_rules(lins))
    return layers


def _fused(group: list[Linear]) -> Linear:
    """One Linear computing ``group``'s products side by side (outputs concatenated), packed as
    the group's first member is."""
    if len(group) == 1:
        return group[0]
    first = group[0]
    fused = Linear(first.in_features, sum(lin.out_features for lin in group), bias=first.bias is not None)
    fused.to(device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in group]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias for lin in group]))
    fused.requires_grad_(False)
    if first.packed is not None:
        fused.pack(first.single_rows)
    return fused


def head_layer(head: nn.Module) -> Any | None:
    """The C++ draft step of a feature head (``csrc/decode.cpp``'s HeadLayer), or None where it
    does not apply (not CPU, turned off, no extension). ``head.cpp_parts()`` gives (eagle,
    norms, groups of linears fused into one product each). Captures the weights as they are
    now: build it again after changing them."""
    first = next(head.parameters())
    if not enabled() or first.device.type != "cpu":
        return None
    parts = head.cpp_parts()
    ext = extension() if parts is not None else None
    if ext is None:
        return None
    eagle, norms, groups = parts
    c = head.config
    lins = [_fused(list(g)) for g in groups]
    layer = ext.HeadLayer(c.num_heads, c.num_kv_heads, c.head_dim, eagle, float(c.rms_norm_eps))
    layer.set([n.weight for n in norms], [t for lin in lins for t in _linear_parts(lin)],
              *_rules(lins))
    return layer
