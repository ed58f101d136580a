"""msgspec codec for bus messages, with arrays and tensors as out-of-band frames.

Wire layout of one message (a list of ZeroMQ frames):

    frame 0     : [kind: 1 byte][msgpack of the message struct (an array of its fields, in order)]
    frames 1..n : raw buffers of the arrays/tensors the message holds, in the order met

Inside the msgpack body an array is ExtType(1, msgpack([frame_index, dtype, shape])), dtype "np:<str>"
or "torch:<name>"; nested structs are plain msgpack arrays, typed by their parent's annotations (and
commands by their tag). The bytes of an array never pass through msgpack, so a large tensor costs one
memcpy into the socket (or none with zero-copy sends). Decoding is typed: the kind byte names the
struct, and msgspec checks every field (count, types); a field annotated np.ndarray accepts only an
array frame. No pickle: what comes back is scalars/containers, numpy arrays, torch tensors (only
inside fields typed Any, e.g. an Ack's result) and the structs of bus.messages.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import numpy as np

from bus.messages import PROTOCOL_FINGERPRINT, PROTOCOL_VERSION, REGISTRY, Hello, HelloPreamble

_EXT_ARRAY = 1

# torch dtypes without a numpy twin travel as same-width integers and are re-viewed on arrival.
_TORCH_VIEW_AS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_pack = msgspec.msgpack.encode
_unpack = msgspec.msgpack.decode


class CodecError(ValueError):
    pass


class _Local(threading.local):
    """Per-thread encoder/decoders (a member's heartbeat thread encodes concurrently with its loop)."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.frames: list[Any] = []
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.decoders = {k: msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook, dec_hook=_dec_hook)
                         for k, cls in REGISTRY.items()}



def encode(msg: Any) -> list[Any]:
    """Message -> frames (bytes / memoryview)."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None:
        raise CodecError(f"{type(msg).__name__} is not a bus message")
    state = _local
    state.buffers = buffers = []
    try:
        body = state.encoder.encode(msg)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode {type(msg).__name__}: {e}") from e
    finally:
        state.buffers = []
    return [bytes((kind,)) + body, *buffers]


def decode(frames: list[Any]) -> Any:
    """Frames -> message. Raises CodecError on anything malformed (callers drop and log it)."""
    if not frames:
        raise CodecError("empty message")
    head = _as_bytes(frames[0])
    if not head:
        raise CodecError("empty header frame")
    state = _local
    dec = state.decoders.get(head[0])
    if dec is None:
        raise CodecError(f"unknown message kind {head[0]}")
    state.frames = frames
    try:
        return dec.decode(memoryview(head)[1:])
    except CodecError:
        raise
    except Exception as e:  # msgspec.DecodeError/ValidationError, or a bad array header
        if head[0] == Hello.KIND and (old := _other_protocol(memoryview(head)[1:])) is not None:
            return old
        raise CodecError(f"bad {REGISTRY[head[0]].__name__}: {e}") from e
    finally:
        state.frames = []


def _other_protocol(body: memoryview) -> Hello | None:
    """The Hello of a peer on another protocol version, whose body no longer decodes as ours: its shared
    leading fields, so that the coordinator can refuse it naming both versions (its own info is dropped)."""
    try:
        p = _preamble.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if (p.protocol_version, p.protocol_fingerprint) == (PROTOCOL_VERSION, PROTOCOL_FINGERPRINT):
        return None  # our own version: the body is simply bad
    return Hello(p.role, p.name, p.pid, p.protocol_version, None, p.protocol_fingerprint)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        buffers = _local.buffers
        buffers.append(memoryview(arr).cast("B") if arr.size else b"")
        return msgspec.msgpack.Ext(_EXT_ARRAY, _pack((len(buffers), "np:" + arr.dtype.str, arr.shape)))
    if _is_tensor(obj):
        return _encode_tensor(obj)
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise CodecError(f"cannot encode {type(obj).__name__} on the bus")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_ARRAY:
        raise CodecError(f"unknown ext type {code}")
    try:
        index, dtype, shape = _array_header.decode(data)
    except msgspec.DecodeError as e:  # malformed, or not [int, str, [int, ...]]
        raise CodecError(f"bad array header: {e}") from e
    frames = _local.frames
    if not 0 < index < len(frames):
        raise CodecError(f"array refers to missing frame {index}")
    if shape and min(shape) < 0:
        raise CodecError(f"bad array header: negative dimension in {shape}")
    return _decode_array(frames[index], dtype, shape)


def _dec_hook(typ: type, obj: Any) -> Any:
    if isinstance(obj, typ):
        return obj
    raise TypeError(f"expected an array frame, got {type(obj).__name__}")


def _as_bytes(frame: Any) -> bytes | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    return frame.buffer  # zmq.Frame received with copy=False


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter")


def _encode_tensor(t: Any) -> msgspec.msgpack.Ext:
    t = t.detach()
    if t.device.type != "cpu":
        raise CodecError("only host tensors travel on the bus; device tensors use the IPC/collective paths")
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    view_as = _TORCH_VIEW_AS.get(name)
    import torch

    arr = (t.view(getattr(torch, view_as)) if view_as else t).numpy()
    buffers = _local.buffers
    buffers.append(memoryview(arr).cast("B") if arr.size else b"")
    return msgspec.msgpack.Ext(_EXT_ARRAY, _pack((len(buffers), "torch:" + name, list(t.shape))))


def _decode_array(frame: Any, dtype: str, shape: list[int]) -> Any:
    buf = _as_bytes(frame)
    lib, _, name = dtype.partition(":")
    try:
        if lib == "np":
            dt = _np_dtype(name)
            # one constructor call, the frame's bytes as the buffer (read-only, like the frame): about half the
            # cost of frombuffer + reshape, which counts on the scheduler's path for each array of a StepResult
            arr = np.ndarray(shape, dt, buf)
            if arr.nbytes != len(buf):  # the constructor only refuses a buffer that is too small
                raise CodecError(f"bad array frame ({dtype} {shape}): {len(buf)} bytes for {arr.nbytes}")
            return arr
        if lib == "torch":
            import torch

            view_as = _TORCH_VIEW_AS.get(name)
            tdtype = getattr(torch, name, None)
            if not isinstance(tdtype, torch.dtype):
                raise CodecError(f"unknown torch dtype {name!r}")
            np_dtype = np.dtype(view_as) if view_as else torch.empty(0, dtype=tdtype).numpy().dtype
            # Copy into a writable tensor: zmq frames are read-only and torch would otherwise alias them.
            arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
            t = torch.from_numpy(arr.copy())
            return t.view(tdtype) if view_as else t
    except CodecError:
        raise
    except (ValueError, TypeError) as e:  # a truncated frame, a shape that does not fit, a bad dtype
        raise CodecError(f"bad array frame ({dtype} {shape}): {e}") from e
    raise CodecError(f"unknown array type {dtype}")


def _np_dtype(name: str) -> np.dtype:
    dt = _np_dtypes.get(name)
    if dt is None:
        dt = np.dtype(name)
        if dt.hasobject:  # raw bytes as object pointers: never
            raise CodecError(f"object dtype {name!r} cannot travel as an array frame")
        if len(_np_dtypes) < 64:  # the handful a bus carries; a peer cannot grow it without bound
            _np_dtypes[name] = dt
    return dt


_array_header = msgspec.msgpack.Decoder(tuple[int, str, list[int]])
_preamble = msgspec.msgpack.Decoder(HelloPreamble)
_np_dtypes: dict[str, np.dtype] = {}
_local = _Local()
