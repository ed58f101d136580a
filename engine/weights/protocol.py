"""The weight-update protocol shared by the trainer client and the workers. Pure: no sockets, no devices.

One update of the engine's weights is a list of tensors described by `UpdateMeta` (names, dtype names,
shapes: vLLM's update_info fields, decoded and checked at the edge by engine.weights.wire). This module
computes the packed chunk boundaries both sides must agree on, and views and packs their bytes.

Packing follows vLLM's packed_tensor.py rule, so a vLLM trainer's packed broadcast lines up with ours:
tensors are flattened to bytes and appended to the current chunk in order; a chunk is closed as soon as
its running total exceeds the buffer size (so a chunk holds at least one tensor, and may exceed the
buffer by less than one tensor). The IPC backend's shared buffers instead need chunks that fit: see
`plan_chunks(..., fit=True)`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bus.messages import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, CollectiveUpdateInfo  # noqa: F401
from engine.weights.wire import DTYPE_NAMES, WeightSyncError, check_update, decode  # noqa: F401 (WeightSyncError: here too)

# What rollbus's trainer client packs by when not told (it sends the size, so both sides agree): chunks of
# a few tens of MiB keep num_buffers in flight, so packing, moving and unpacking overlap. One chunk of
# vLLM's 1 GiB holds a whole small model: SmolLM2 over Gloo then packed, broadcast and unpacked in turn.
CLIENT_PACKED_BUFFER_SIZE_BYTES = 64 << 20
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype | None:
    """Any torch dtype by name (vLLM's, or with the "torch." prefix): None when there is none."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True, slots=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class UpdateMeta:
    params: list[ParamMeta]

    @classmethod
    def parse(cls, info: Any) -> UpdateMeta:
        """The tensors an update_info declares. A dict (a test's, a tool's) is decoded and checked as the edge
        does (engine.weights.wire: a 400 naming the field); a struct off the bus was checked there already."""
        if isinstance(info, dict):
            info = decode(info, CollectiveUpdateInfo, "update_info")
            check_update(info)
        return cls([ParamMeta(n, torch_dtype(d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names,
                                                                                info.shapes)])

    def to_info(self) -> dict[str, Any]:
        return {"names": [p.name for p in self.params], "dtype_names": [dtype_name(p.dtype) for p in self.params],
                "shapes": [list(p.shape) for p in self.params]}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def plan_chunks(params: list[ParamMeta], buffer_size: int, fit: bool = False) -> list[list[int]]:
    """Indices of `params` per packed chunk.

    fit=False (collectives): vLLM's rule, close a chunk once its total exceeds buffer_size.
    fit=True (IPC shared buffers): a chunk never exceeds buffer_size; one tensor larger than the buffer
    is an error naming it.
    """
    if buffer_size <= 0:
        raise WeightSyncError(f"packed_buffer_size_bytes must be positive, got {buffer_size}",
                              param="packed_buffer_size_bytes")
    chunks: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, p in enumerate(params):
        n = p.nbytes
        if fit and n > buffer_size:
            raise WeightSyncError(f"tensor {p.name!r} ({n} bytes) is larger than packed_buffer_size_bytes="
                                  f"{buffer_size}", param="packed_buffer_size_bytes")
        if fit and cur and total + n > buffer_size:
            chunks.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
        if not fit and total > buffer_size:
            chunks.append(cur)
            cur, total = [], 0
    return chunks + [cur] if cur else chunks


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in row-major order: what /weight_checker reports per tensor, and
    what a trainer computes on its own copy to verify an update bit for bit."""
    import hashlib

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def byte_views(buf: torch.Tensor, params: list[ParamMeta]) -> list[torch.Tensor]:
    """Typed tensors over consecutive byte ranges of a flat uint8 buffer (packed layout); misaligned
    ranges are copied out so they can be viewed as their dtype."""
    out, off = [], 0
    for p in params:
        raw = buf[off:off + p.nbytes]
        off += p.nbytes
        if raw.data_ptr() % p.dtype.itemsize:
            raw = raw.clone()
        out.append(raw.view(p.dtype).view(p.shape))
    return out


def pack(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Copy tensors back to back into a flat uint8 buffer; returns (offset, nbytes) of each."""
    from ascend_ops.platform import bulk_copy_threads

    out, off = [], 0
    with bulk_copy_threads() as copy:
        for t in tensors:
            n = t.numel() * t.element_size()
            copy(buf[off:off + n], t.reshape(-1).view(torch.uint8))
            out.append((off, n))
            off += n
    return out


def relocate(tensors: list[torch.Tensor], flat: torch.Tensor, offsets: list[int]) -> None:
    """Move each tensor's bytes to ``flat[offset:]`` (a uint8 buffer) and re-point its ``.data`` there: a
    parameter keeps its identity (optimizers hold the same object), only its memory moves."""
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            view = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view


def byte_span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 view of the tensors' bytes when they lie back to back in one storage, in this order (what
    ``pack`` would write), else None."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return None
        end += t.numel() * t.element_size()
    start = first.data_ptr() - first.untyped_storage().data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), start, (end - first.data_ptr(),))


def owner_lookup(params: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], str | None]:
    """The name of the parameter a view lies in, by address (parameters serving from a lent segment share
    its storage, so the storage does not tell them apart); None for none."""
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), n) for n, p in params.items()
                   if p.numel())
    starts = [a for a, _, _ in spans]

    def owner(t: torch.Tensor) -> str | None:
        i = bisect_right(starts, t.data_ptr()) - 1
        return spans[i][2] if i >= 0 and t.data_ptr() < spans[i][1] else None
    return owner
