"""msgpack codec for bus messages, with arrays and tensors as out-of-band frames.

Wire layout of one message (a list of ZeroMQ frames):

    frame 0     : [kind: 1 byte][msgpack of the message's fields, in declaration order]
    frames 1..n : raw buffers of the arrays/tensors the message holds, in the order met

Inside the msgpack body an array is ExtType(1, msgpack([frame_index, dtype, shape])) and a nested
message is ExtType(2, msgpack([kind, *fields])). The bytes of an array never pass through msgpack, so a
large tensor costs one memcpy into the socket (or none with zero-copy sends). No pickle: the only
objects that can come back are msgpack scalars/containers, numpy arrays, torch tensors and the message
classes in bus.messages.REGISTRY.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from bus.messages import REGISTRY

_EXT_ARRAY = 1
_EXT_MESSAGE = 2

# torch dtypes without a numpy twin travel as same-width integers and are re-viewed on arrival.
_TORCH_VIEW_AS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


class CodecError(ValueError):
    pass


def encode(msg: Any) -> list[Any]:
    """Message -> frames (bytes / memoryview)."""
    buffers: list[Any] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            buffers.append(memoryview(arr).cast("B") if arr.size else b"")
            return msgpack.ExtType(_EXT_ARRAY, msgpack.packb([len(buffers), "np:" + arr.dtype.str, arr.shape]))
        if _is_tensor(obj):
            return _encode_tensor(obj, buffers)
        kind = getattr(type(obj), "KIND", None)
        if kind is not None and dataclasses.is_dataclass(obj):
            body = msgpack.packb([kind, *_fields(obj)], default=default)
            return msgpack.ExtType(_EXT_MESSAGE, body)
        if isinstance(obj, (np.integer, np.floating, np.bool_)):
            return obj.item()
        raise CodecError(f"cannot encode {type(obj).__name__} on the bus")

    kind = getattr(type(msg), "KIND", None)
    if kind is None:
        raise CodecError(f"{type(msg).__name__} is not a bus message")
    head = bytes((kind,)) + msgpack.packb(_fields(msg), default=default)
    return [head, *buffers]


def decode(frames: list[Any]) -> Any:
    """Frames -> message. Raises CodecError on anything malformed (callers drop and log it)."""
    if not frames:
        raise CodecError("empty message")
    head = _as_bytes(frames[0])
    if not head:
        raise CodecError("empty header frame")

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            index, dtype, shape = msgpack.unpackb(data)
            if not 0 < index < len(frames):
                raise CodecError(f"array refers to missing frame {index}")
            return _decode_array(frames[index], dtype, shape)
        if code == _EXT_MESSAGE:
            kind, *fields = msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False)
            return _build(kind, fields)
        raise CodecError(f"unknown ext type {code}")

    try:
        fields = msgpack.unpackb(head[1:], ext_hook=ext_hook, strict_map_key=False)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types on garbage
        raise CodecError(f"undecodable message: {e}") from e
    if not isinstance(fields, list):
        raise CodecError("message body is not a field list")
    return _build(head[0], fields)


def _build(kind: int, fields: list[Any]) -> Any:
    cls = REGISTRY.get(kind)
    if cls is None:
        raise CodecError(f"unknown message kind {kind}")
    try:
        return cls(*fields)
    except TypeError as e:
        raise CodecError(f"bad fields for {cls.__name__}: {e}") from e


def _fields(msg: Any) -> list[Any]:
    return [getattr(msg, f.name) for f in dataclasses.fields(msg)]


def _as_bytes(frame: Any) -> bytes | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    return frame.buffer  # zmq.Frame received with copy=False


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter")


def _encode_tensor(t: Any, buffers: list[Any]) -> msgpack.ExtType:
    t = t.detach()
    if t.device.type != "cpu":
        raise CodecError("only host tensors travel on the bus; device tensors use the IPC/collective paths")
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    view_as = _TORCH_VIEW_AS.get(name)
    import torch

    arr = (t.view(getattr(torch, view_as)) if view_as else t).numpy()
    buffers.append(memoryview(arr).cast("B") if arr.size else b"")
    return msgpack.ExtType(_EXT_ARRAY, msgpack.packb([len(buffers), "torch:" + name, list(t.shape)]))


def _decode_array(frame: Any, dtype: str, shape: list[int]) -> Any:
    buf = _as_bytes(frame)
    lib, _, name = dtype.partition(":")
    if lib == "np":
        arr = np.frombuffer(buf, dtype=np.dtype(name))
        return arr.reshape(shape)
    if lib == "torch":
        import torch

        view_as = _TORCH_VIEW_AS.get(name)
        np_dtype = np.dtype(view_as) if view_as else torch.empty(0, dtype=getattr(torch, name)).numpy().dtype
        # Copy into a writable tensor: zmq frames are read-only and torch would otherwise alias them.
        arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
        t = torch.from_numpy(arr.copy())
        return t.view(getattr(torch, name)) if view_as else t
    raise CodecError(f"unknown array type {dtype}")
