"""The weight-update protocol shared by the trainer client and the workers. Pure: no sockets, no devices.

One update of the engine's weights is a list of tensors described by `UpdateMeta` (names, dtype names,
shapes: vLLM's update_info fields). This module parses and validates that metadata, computes the packed
chunk boundaries both sides must agree on, and defines the errors every layer turns into HTTP statuses.

Packing follows vLLM's packed_tensor.py rule, so a vLLM trainer's packed broadcast lines up with ours:
tensors are flattened to bytes and appended to the current chunk in order; a chunk is closed as soon as
its running total exceeds the buffer size (so a chunk holds at least one tensor, and may exceed the
buffer by less than one tensor). The IPC backend's shared buffers instead need chunks that fit: see
`plan_chunks(..., fit=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024**3  # vLLM's default
DEFAULT_PACKED_NUM_BUFFERS = 2
# What rollbus's trainer client packs by when not told (it sends the size, so both sides agree): chunks of
# a few tens of MiB keep num_buffers in flight, so packing, moving and unpacking overlap. One chunk of
# vLLM's 1 GiB holds a whole small model: SmolLM2 over Gloo then packed, broadcast and unpacked in turn.
CLIENT_PACKED_BUFFER_SIZE_BYTES = 64 << 20

# torch dtype names a trainer may send (vLLM sends str(dtype) without the "torch." prefix).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "double": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}


class WeightSyncError(Exception):
    """A weight-transfer failure with the HTTP status the gateway answers with.

    400: bad metadata (names, shapes, dtypes, lengths, handles), 409: wrong state (update without
    start, start twice, anything after shutdown), 504: a rendezvous or transfer that timed out,
    500: anything else.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
        raise WeightSyncError(f"{where}: unknown dtype {name!r}; expected one of {', '.join(sorted(DTYPES))}",
                              param="dtype_names")
    return DTYPES[name.removeprefix("torch.")]


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
    def parse(cls, info: dict[str, Any]) -> UpdateMeta:
        """Validate vLLM's names / dtype_names / shapes triple; every problem is a 400 naming the field."""
        if not isinstance(info, dict):
            raise WeightSyncError("update_info must be an object", param="update_info")
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        for field, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
            if not isinstance(value, list):
                raise WeightSyncError(f"update_info.{field} must be a list", param=field)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightSyncError(
                f"update_info lists differ in length: names {len(names)}, dtype_names {len(dtypes)}, "
                f"shapes {len(shapes)}", param="names")
        if not names:
            raise WeightSyncError("update_info.names is empty", param="names")
        seen: set[str] = set()
        params = []
        for name, dt, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or not name:
                raise WeightSyncError(f"update_info.names holds a non-string or empty name: {name!r}", param="names")
            if name in seen:
                raise WeightSyncError(f"duplicate tensor name {name!r} in update_info.names", param="names")
            seen.add(name)
            if (not isinstance(shape, list | tuple)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise WeightSyncError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}",
                                      param="shapes")
            params.append(ParamMeta(name, parse_dtype(dt, f"tensor {name!r}"), tuple(shape)))
        return cls(params)

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
        if fit:
            if n > buffer_size:
                raise WeightSyncError(
                    f"tensor {p.name!r} ({n} bytes) is larger than packed_buffer_size_bytes={buffer_size}",
                    param="packed_buffer_size_bytes")
            if cur and total + n > buffer_size:
                chunks.append(cur)
                cur, total = [], 0
            cur.append(i)
            total += n
        else:
            cur.append(i)
            total += n
            if total > buffer_size:
                chunks.append(cur)
                cur, total = [], 0
    if cur:
        chunks.append(cur)
    return chunks


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
        size = p.dtype.itemsize
        if raw.data_ptr() % size:
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
