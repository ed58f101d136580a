"""CPU linear layers on pre-packed weights (oneDNN's, MKL's or our own panel layout): default mode's GEMM on CPU.

torch's CPU `F.linear` repacks the weight matrix into the BLAS kernel's blocked layout on every call. A decode
step multiplies a few dozen rows by every weight of the model, so that repacking is a large share of the
step (measured on SmolLM2-135M, fp32, 1 thread: the LM head at 64 rows runs at about half the large-GEMM
rate with `F.linear` and near it on a packed weight; the layers' GEMMs gain about a third). oneDNN reorders a
weight once (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies on the reordered copy
(`torch.ops.mkldnn._linear_pointwise`), the path inductor's CPU freezing uses.

The packed copy lives on the parameter it was made from (attribute `_rollbus_packed`, with the storage
address it was packed from) and is rebuilt on first use after it is dropped. Anything that changes weights
in place must call `forget(model)` afterwards (the worker does, after every command that may touch weights:
updates, sleep, wake, reloads; sleep drops them itself, before it trims the heap); a parameter whose `.data`
was swapped (its storage address changed) or that was written in place through itself (its version counter
moved: an optimizer step) is repacked on its own.
Writes through `.data` or another alias move neither, hence `forget`. Tensors that are not `nn.Parameter`s
(per-expert slices, activations) take plain `F.linear`: packing a temporary costs more than it saves.

Four packed products, one per parameter and process: oneDNN's (bf16 where oneDNN has a native bf16 path;
fp32 where none of the others is chosen), MKL's packed sgemm (fp32 on Intel CPUs without AVX-512, `cblas_sgemm_pack` /
`cblas_sgemm_compute` through ascend_ops/csrc/cpu_gemm.cpp) and our own kernels over column panels
(ascend_ops/csrc/cpu_panel_gemm.cpp): AVX-512 on 32-wide panels (fp32 on Intel CPUs with AVX-512) and
AVX2/FMA on 16-wide panels (fp32 on other x86 CPUs with AVX2 but no AVX-512, such as AMD Zen 2/3).
Measured, SmolLM2-135M's layer GEMMs, GFLOP/s (`python bench/decode_gemm.py`):
- Intel Xeon (AVX-512, AMX), 32 / 64 rows: 1 thread MKL packed 104-106 / 153-155, the AVX-512 kernel
  131 / 170-173; 2 threads MKL 194-204 / 285-301, the AVX-512 kernel 263-264 / 305-329 (oneDNN packed
  1 thread 101-103 / 132-136). With x packed per tile (2026-12-05, 1 thread, CPU time, load 6-8, two runs
  each): at 16 / 64 / 256 / 2,336 rows 72-75 / 152-154 / 158-167 / 158-165, the kernel before 73-74 /
  142-148 / 155-162 / 156-156 (torch's F.linear 42-46 / 97-109 / 143-166 / 168-174).
- AMD EPYC Zen 3 (AVX2, 1 thread), 16 / 32 / 64 rows: oneDNN packed 36.5 / 48.3 / 54.0, the AVX2 kernel
  51.3 / 57.2 / 65.1 (2 threads at 32 / 64 rows: 79.5 / 103.4 against 101.1 / 112.7), measured before its
  software prefetch (which took it from 69 to 90 GFLOP/s at 32 rows on the Xeon; not measured on Zen 3);
  MKL there ran at two thirds of oneDNN's speed in a decode step.
bf16 where the CPU has no native bf16 (no AVX512-BF16, AMX or AVX-NE-CONVERT: AMD Zen 2/3, Intel before Cooper
Lake, where oneDNN has no bf16 path or an emulated one) multiplies on the widest panel kernel instead: the
weights packed as bf16 panels (half the bytes an fp32 pack streams), widened to fp32 in registers (exact: a
bf16 is an fp32's top 16 bits), the activations widened once per call, every output summed in fp32 and
rounded to bf16 once, as torch's bf16 linear rounds its fp32 sums (the summation order is the fp32 panel
kernel's, so not bitwise F.linear's; the oracle tests' bf16 tolerance holds). torch's own bf16 linear there
runs a slow reference loop (the whole decode ~7x slower than fp32).
CPUs with AVX-512 other than Intel's (AMD Zen 4) keep oneDNN: there, 2 threads, the AVX-512 kernel ran 6-19%
faster than oneDNN at 16-128 rows but 12% slower at 1,024 (an RL rollout's wide step; docs/serving.md).
`ROLLBUS_CPU_PACKED_LINEAR` chooses: `1` (the default: as above), `onednn`, `mkl` (fp32 on MKL whatever the
CPU; refused where this torch has no MKL), `avx2` / `avx512` (fp32 on that panel kernel whatever the CPU;
refused where the kernels were built without that instruction set; bf16 too, widened to fp32 as above,
whatever the CPU), `0` (packing off, plain `F.linear`). Under `1` and `mkl` bf16 takes oneDNN's native path
where the CPU has one, else a panel kernel; under `onednn` bf16 takes oneDNN's native path or, without one,
oneDNN's emulated one (AVX-512 without bf16 instructions) or plain `F.linear` (as before the panel kernels
read bf16).

Default and batch-invariant kernels on CPU (oneDNN's and MKL's packed products were measured row-invariant
for four rows or more, the panel kernels are for any rows by construction, and the invariant linear pads to
that; its start-up self-check measures it); accelerators keep their vendor GEMMs.
"""

from __future__ import annotations

import functools
import os

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from ascend_ops import cpu_kernels

log = structlog.get_logger()

ENV = "ROLLBUS_CPU_PACKED_LINEAR"
CHOICES = ("1", "0", "onednn", "mkl", "avx2", "avx512")
PANEL_WIDTHS = {"avx2": 16, "avx512": 32}  # our panel kernels: backend -> pack width (cpu_panel_gemm.cpp)
MKL_PACK_ROWS = 64  # the rows MKL's pack is laid out for (any number works; 64 measured best at 32-256 rows)
_ATTR = "_rollbus_packed"
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's primitive takes here: bf16 only where oneDNN has a native bf16 path on this CPU
    (AVX512-BF16/AMX, or AVX-NE-CONVERT; an AVX2-only CPU such as AMD Zen 3 has none: there its reorder
    raises, and bf16 parameters multiply on a panel kernel, `bf16_backend`)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # absent without oneDNN
    return _DTYPES if supported is not None and supported() else (torch.float32,)


NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # x86 flags of bf16 instructions


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively here: an x86 CPU with bf16 instructions (`NATIVE_BF16`; oneDNN
    also takes bf16 on AVX-512 CPUs without them, emulated), or oneDNN's word for it on another architecture."""
    if torch.bfloat16 not in _dtypes():
        return False
    flags = cpu_kernels.cpu_flags()
    return not ({"avx2", "avx512f"} & flags) or bool(set(NATIVE_BF16) & flags)


def _choice() -> str:
    value = os.environ.get(ENV, "1").strip() or "1"
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def _kernel_unavailable(op: str, *args: int) -> str | None:
    """None when the CPU kernels build here and their `op` (a reason or "") says this product works."""
    ops = cpu_kernels.ops()
    if ops is None:
        return f"the CPU kernels are unavailable ({cpu_kernels.unavailable()})"
    return getattr(ops, op)(*args) or None


@functools.cache
def mkl_unavailable() -> str | None:
    """None when the MKL packed sgemm (ascend_ops/csrc/cpu_gemm.cpp) works here, else why not."""
    return _kernel_unavailable("mkl_gemm_unavailable")


@functools.cache
def panel_unavailable(backend: str = "avx2") -> str | None:
    """None when the panel kernel `backend` ("avx2" or "avx512", ascend_ops/csrc/cpu_panel_gemm.cpp) works
    here, else why not."""
    return _kernel_unavailable("panel_gemm_unavailable", PANEL_WIDTHS[backend])


def _has_avx512() -> bool:
    return "avx512f" in cpu_kernels.cpu_flags()


@functools.cache
def fp32_backend() -> str:
    """"avx512", "mkl", "avx2" or "onednn": the packed product fp32 parameters use in default mode (module
    docstring)."""
    value = _choice()
    if value in ("mkl", *PANEL_WIDTHS):
        why = mkl_unavailable() if value == "mkl" else panel_unavailable(value)
        if why:
            raise ValueError(f"{ENV}={value}: {why}")
        return value
    intel = _cpu_vendor() == "GenuineIntel"
    if value == "1" and intel and _has_avx512() and panel_unavailable("avx512") is None:
        return "avx512"
    if value == "1" and intel and mkl_unavailable() is None:
        return "mkl"
    if value == "1" and _cpu_vendor() != "GenuineIntel" and not _has_avx512() and panel_unavailable() is None:
        return "avx2"
    return "onednn"


@functools.cache
def bf16_backend() -> str | None:
    """"onednn", "avx512" or "avx2": the packed product bf16 parameters use (module docstring), or None where
    none does (they take plain F.linear)."""
    value = _choice()
    if value in PANEL_WIDTHS:
        fp32_backend()  # refuses, naming why, where that kernel is missing
        return value
    onednn = "onednn" if torch.bfloat16 in _dtypes() else None
    if native_bf16() or value == "onednn":
        return onednn
    return next((b for b in ("avx512", "avx2") if panel_unavailable(b) is None), onednn)


@functools.cache
def available() -> str | None:
    """None when packed linears work here, else why not (checked once per process on a small product)."""
    value = _choice()
    if value == "0":
        return f"{ENV}=0"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch build lacks mkldnn._reorder_linear_weight / _linear_pointwise"
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        got = ops._linear_pointwise(x, ops._reorder_linear_weight(w), b, "none", [], "")
        if not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5):
            return "the oneDNN packed linear disagrees with F.linear on a check product"
    except (RuntimeError, NotImplementedError) as e:
        return f"the oneDNN packed linear failed a check product: {e}"
    return None


def describe(dtype: torch.dtype = torch.float32) -> str:
    """What a CPU model of this dtype multiplies on: "<backend>-prepacked" (avx512, mkl, avx2, onednn) or why
    none."""
    why = available()
    if why is not None:
        return f"torch (packed off: {why})"
    backend = backend_for(dtype)
    if backend is None:
        return "torch (no packed bf16 product on this CPU)"
    if dtype == torch.bfloat16 and backend in PANEL_WIDTHS:
        return f"{backend}-prepacked (bf16 weights, fp32 sums)"
    return f"{backend}-prepacked"


def backend_for(dtype: torch.dtype) -> str | None:
    """The packed product a parameter of this dtype uses: fp32 `fp32_backend()`, bf16 `bf16_backend()`, else
    None."""
    if dtype == torch.float32:
        return fp32_backend()
    return bf16_backend() if dtype == torch.bfloat16 else None


def packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies this on a packed copy (else it is plain F.linear)."""
    return (isinstance(weight, nn.Parameter) and weight.device.type == "cpu" and weight.dtype in _DTYPES
            and x.dtype == weight.dtype and weight.dim() == 2 and weight.numel() > 0 and available() is None
            and backend_for(weight.dtype) is not None)


def row_invariant(weight: torch.Tensor) -> bool:
    """Whether this parameter's packed product gives a row the same bits at any number of rows (the panel
    kernels, by construction; oneDNN's and MKL's from four rows, batch_invariant pads to that)."""
    return backend_for(weight.dtype) in PANEL_WIDTHS


def cpu_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN's primitive takes these operands (a parameter or not): a 2-D CPU weight of a dtype it
    multiplies here, x of the same dtype, packing not turned off."""
    return (weight.device.type == "cpu" and weight.dtype in _dtypes() and x.dtype == weight.dtype
            and weight.dim() == 2 and weight.numel() > 0 and available() is None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the weight's packed copy when it is a CPU parameter of a packable dtype (no autograd:
    ascend_ops.batch_invariant wraps it for the trainer side)."""
    return product(x, weight, bias) if packable(x, weight) else F.linear(x, weight, bias)


def product(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None, *,
            backend: str | None = None) -> torch.Tensor:
    """The product on the packed copy, for a caller that has checked `packable` already; `backend` chooses
    ("onednn", "mkl", "avx2" or "avx512"), else `backend_for` the weight's dtype."""
    backend = backend or backend_for(weight.dtype)
    packed = _packed(weight, backend)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if backend == "mkl":
        out = cpu_kernels.ops().mkl_packed_linear(x2, packed, weight.shape[0], weight.shape[1], bias)
    elif backend in PANEL_WIDTHS:
        out = cpu_kernels.ops().panel_linear(x2, packed, weight.shape[0], weight.shape[1], bias, PANEL_WIDTHS[backend])
    else:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], -1)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """Rows of x sorted into groups (group g: rows offsets[g] .. offsets[g + 1], int64 [G + 1]) each times its
    group's weight of the stack `weight` [G, N, K] (an MoE layer's experts and the tokens routed to them), on
    one packed copy of the whole stack and one call that threads over the (expert, panel) pairs with rows:
    each row's outputs are the bits `linear` gives it on its expert's weight alone. None where the stack is not a
    CPU parameter or its dtype's product is not a panel kernel (the caller then multiplies expert by expert)."""
    if not (isinstance(weight, nn.Parameter) and weight.device.type == "cpu" and weight.dim() == 3
            and weight.dtype in _DTYPES and x.dtype == weight.dtype and weight.numel() > 0
            and available() is None and backend_for(weight.dtype) in PANEL_WIDTHS):
        return None
    backend = backend_for(weight.dtype)
    return cpu_kernels.ops().panel_grouped_linear(x, _packed(weight, backend), offsets, weight.shape[1],
                                                  weight.shape[2], PANEL_WIDTHS[backend])


def _packed(weight: nn.Parameter, backend: str) -> torch.Tensor:
    entry = getattr(weight, _ATTR, None)
    key = (weight.data_ptr(), weight._version, backend)  # a .data swap, an in-place write through the parameter
    if entry is None or entry[0] != key:
        with torch.no_grad():
            w = weight.detach().contiguous()
            if backend == "mkl":
                packed = cpu_kernels.ops().mkl_pack(w, MKL_PACK_ROWS)
            elif backend in PANEL_WIDTHS:
                packed = cpu_kernels.ops().panel_pack(w, PANEL_WIDTHS[backend])
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w)
            entry = (key, packed)
        setattr(weight, _ATTR, entry)
    return entry[1]


def forget(model: nn.Module) -> int:
    """Drop every packed copy under `model` (its weights changed, or are being released); returns how many."""
    n = 0
    for p in model.parameters():
        if getattr(p, _ATTR, None) is not None:
            setattr(p, _ATTR, None)
            n += 1
    return n


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by packed copies now (they come on top of the weights themselves)."""
    return sum(e[1].numel() * e[1].element_size() for p in model.parameters()
               if (e := getattr(p, _ATTR, None)) is not None)
