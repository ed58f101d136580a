"""CPU linear layers on pre-packed (oneDNN-reordered) weights: default mode's GEMM on CPU.

torch's CPU `F.linear` repacks the weight matrix into the BLAS kernel's blocked layout on every call. A decode
step multiplies a few dozen rows by every weight of the model, so that repacking is a large share of the
step (measured on SmolLM2-135M, fp32, 1 thread: the LM head at 64 rows runs at about half the large-GEMM
rate with `F.linear` and near it on a packed weight; the layers' GEMMs gain about a third). oneDNN reorders a
weight once (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies on the reordered copy
(`torch.ops.mkldnn._linear_pointwise`), the path inductor's CPU freezing uses.

The packed copy lives on the parameter it was made from (attribute `_rollbus_packed`, with the storage
address it was packed from) and is rebuilt on first use after it is dropped. Anything that changes weights
in place must call `forget(model)` afterwards (the worker does, after every command that may touch weights:
updates, sleep, wake, reloads); a parameter whose `.data` was swapped (its storage address changed) or that
was written in place through itself (its version counter moved: an optimizer step) is repacked on its own.
Writes through `.data` or another alias move neither, hence `forget`. Tensors that are not `nn.Parameter`s
(per-expert slices, activations) take plain `F.linear`: packing a temporary costs more than it saves.

Default and batch-invariant kernels on CPU (the packed product is row-invariant for four rows or more, and
the invariant linear pads to that; its start-up self-check measures it); accelerators keep their vendor
GEMMs. `ROLLBUS_CPU_PACKED_LINEAR=0` turns packing off (plain `F.linear`).
"""

from __future__ import annotations

import functools
import os

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger()

ENV = "ROLLBUS_CPU_PACKED_LINEAR"
_ATTR = "_rollbus_packed"
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def available() -> str | None:
    """None when packed linears work here, else why not (checked once per process on a small product)."""
    value = os.environ.get(ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
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


def describe() -> str:
    why = available()
    return "onednn-prepacked" if why is None else f"torch (packed off: {why})"


def packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies this on a packed copy (else it is plain F.linear)."""
    return (isinstance(weight, nn.Parameter) and weight.device.type == "cpu" and weight.dtype in _DTYPES
            and x.dtype == weight.dtype and weight.dim() == 2 and weight.numel() > 0 and available() is None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the weight's packed copy when it is a CPU parameter of a packable dtype (no autograd:
    ascend_ops.batch_invariant wraps it for the trainer side)."""
    return product(x, weight, bias) if packable(x, weight) else F.linear(x, weight, bias)


def product(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product on the packed copy, for a caller that has checked `packable` already."""
    packed = _packed(weight)
    if x.dim() != 2:
        lead = x.shape[:-1]
        return torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "").view(
            *lead, -1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed(weight: nn.Parameter) -> torch.Tensor:
    entry = getattr(weight, _ATTR, None)
    key = (weight.data_ptr(), weight._version)  # a .data swap, or an in-place write through the parameter
    if entry is None or entry[0] != key:
        with torch.no_grad():
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()))
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
