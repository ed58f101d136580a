"""vLLM's init_info / update_info decoded at the edge, once: the gateway's routes decode a trainer's JSON and
the coordinator checks a WeightUpdateEvent's updates into the typed structs of bus.messages, refusing there
what does not fit with vLLM's field names (a 400 naming the field). Pure and torch-free (the gateway never
imports torch); a worker checks what passes only against its model (names, shapes, dtypes).

A refused update_info still travels to the workers, as a RefusedUpdate: with the collective backend the
trainer is broadcasting the call's tensors while the engine answers, so every worker takes part in those
broadcasts and drops the bytes (or tears the group down when they cannot be sized) before the call fails,
and the lifecycle's abort rule ends the update on every worker, as for a refusal of the worker's own.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import msgspec

from bus.codec import CodecError
from bus.messages import (
    CollectiveUpdateInfo,
    InitInfo,
    NonNegative,
    Positive,
    RefusedUpdate,
    TransferPayload,
    UpdateInfo,
)

# torch dtype names a trainer may send (vLLM sends str(dtype) without the "torch." prefix)
DTYPE_NAMES = ("float32", "float", "bfloat16", "float16", "half", "float64", "double", "int8", "uint8", "int16",
               "int32", "int64", "bool")
LISTS = ("names", "dtype_names", "shapes")
NOT_CONFIGURED = ("weight transfer is not configured: start the server with --weight-transfer-config "
                  "'{\"backend\": \"ipc\"}' (or hccl)")
_EXPECTED = {  # what each field must be, for the 400 that names it
    "names": "a list of tensor names (a non-string or empty name is refused)",
    "dtype_names": "a list of dtype names", "shapes": "a list of shapes, each a list of non-negative ints",
    "packed": "true or false", "packed_buffer_size_bytes": "a positive integer",
    "packed_num_buffers": "a positive integer", "world_size": "a non-negative integer",
    "rank_offset": "a non-negative integer", "master_address": "a host name or address",
    "master_port": "a port number", "timeout_s": "a positive number", "nccl_unique_id_b64": "base64 text",
    "ipc_handles": "a list of handles (one per tensor) or one handle object (packed)",
    "ipc_handles_pickled": "base64 text", "tensor_sizes": "a list of byte counts",
}


class WeightSyncError(Exception):
    """A weight-transfer failure with the HTTP status the gateway answers with.

    400: bad metadata (names, shapes, dtypes, lengths, handles), 409: wrong state (update without start,
    start twice, anything after shutdown), 504: a rendezvous or transfer that timed out, 500: anything else.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def decode(raw: Any, cls: type[TransferPayload], where: str) -> Any:
    """A trainer's JSON object as `cls`; WeightSyncError (400) naming the first field that does not fit."""
    if isinstance(raw, TransferPayload):
        raw = msgspec.structs.asdict(raw)
    if not isinstance(raw, dict):
        raise WeightSyncError(f"{where} must be an object", param=where)
    try:
        msgspec.msgpack.encode(raw)
    except OverflowError as e:  # the gateway's CodecError handler: "integers must fit in 64 bits"
        raise CodecError(f"{where}: {e}") from None
    known = cls.__struct_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise WeightSyncError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}", param=unknown[0])
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        m = re.search(r"`\$\.(\w+)|field `(\w+)`", str(e))
        field = (m[1] or m[2]) if m else where
        raise WeightSyncError(f"{where}.{field} must be {_EXPECTED.get(field, 'valid')}, got {raw.get(field)!r}",
                              param=field) from None


def decode_init(raw: Any, cls: type[TransferPayload]) -> InitInfo:
    """init_info for the engine's backend: the fields, and a rendezvous the worker can attempt."""
    info = decode(raw, cls, "init_info")
    if getattr(info, "world_size", None) is not None:  # a collective rendezvous: one way of two
        if info.nccl_unique_id_b64:
            if info.master_address is not None or info.master_port is not None:
                raise WeightSyncError("init_info: pass nccl_unique_id_b64 OR master_address/master_port, not both",
                                      param="nccl_unique_id_b64")
            nccl_unique_id(info.nccl_unique_id_b64)
        elif not info.master_address:
            raise WeightSyncError("init_info.master_address must be a host name or address", param="master_address")
        elif info.master_port is None:
            raise WeightSyncError("init_info.master_port must be a port number, got None", param="master_port")
    return info


def nccl_unique_id(b64: str) -> bytes:
    try:
        uid = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise WeightSyncError("init_info.nccl_unique_id_b64 is not valid standard base64 (URL-safe base64 is not "
                              "accepted)", param="nccl_unique_id_b64") from None
    if len(uid) != 128:
        raise WeightSyncError(f"init_info.nccl_unique_id_b64 must decode to 128 bytes, got {len(uid)}",
                              param="nccl_unique_id_b64")
    return uid


def check_update(info: Any, reuse_empty: bool = False) -> None:
    """vLLM's names / dtype_names / shapes: as long as each other, names unique, dtypes known. All three empty
    is vLLM 0.33's "the same tensors as last time" where `reuse_empty` (the worker resolves it)."""
    names, dtypes, shapes = info.names, info.dtype_names, info.shapes
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(f"update_info lists differ in length: names {len(names)}, dtype_names {len(dtypes)}, "
                              f"shapes {len(shapes)}", param="names")
    if not names and not reuse_empty:
        raise WeightSyncError("update_info.names is empty", param="names")
    seen: set[str] = set()
    for name, dt in zip(names, dtypes):
        if not name:
            raise WeightSyncError("update_info.names holds a non-string or empty name: ''", param="names")
        if name in seen:
            raise WeightSyncError(f"duplicate tensor name {name!r} in update_info.names", param="names")
        seen.add(name)
        if dt.removeprefix("torch.") not in DTYPE_NAMES:
            raise WeightSyncError(f"tensor {name!r}: unknown dtype {dt!r}; expected one of "
                                  f"{', '.join(sorted(DTYPE_NAMES))}", param="dtype_names")


def decode_update(raw: Any, cls: type[TransferPayload]) -> UpdateInfo:
    """The edge's reading of one update_info (JSON, or a struct off the bus) for a backend whose payload is
    `cls`: the checked struct, or the RefusedUpdate the workers end the call with."""
    try:
        if isinstance(raw, TransferPayload) and type(raw) is not cls:
            raise WeightSyncError(f"update_info is a {type(raw).__name__}; this engine's backend takes "
                                  f"{cls.__name__}", param="update_info")
        info = decode(raw, cls, "update_info")
        check_update(info, reuse_empty=cls.REUSES_LAST)
        return info
    except WeightSyncError as e:
        return RefusedUpdate(str(e), e.param or "update_info", _wire(raw))


def _wire(raw: Any) -> CollectiveUpdateInfo | None:
    """What a trainer broadcasts for a refused call, read leniently (any name, any dtype name, the packing
    fields that parse) so the workers can still take part; None when the broadcasts cannot be sized."""
    if isinstance(raw, TransferPayload):
        raw = msgspec.structs.asdict(raw)
    lists = [raw.get(k) for k in LISTS] if isinstance(raw, dict) else []
    if not lists or not all(isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1:
        return None

    def lenient(value: Any, typ: Any) -> Any:
        try:
            return msgspec.convert(value, typ)
        except msgspec.ValidationError:
            return None

    dtypes, shapes = lenient(lists[1], list[str]), lenient(lists[2], list[list[NonNegative]])
    if dtypes is None or shapes is None:
        return None
    return CollectiveUpdateInfo([str(n) for n in lists[0]], dtypes, shapes, lenient(raw.get("packed"), bool),
                                *(lenient(raw.get(k), Positive) for k in ("packed_buffer_size_bytes",
                                                                          "packed_num_buffers")))
