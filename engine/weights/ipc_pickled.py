"""vLLM's pickled IPC handles (``update_info.ipc_handles_pickled``), read without unpickling anything of torch's.

base64(pickle.dumps(handles)): a list (one per tensor) or one dict (packed) of {device_key: args}, args being
reduce_tensor's: 15 fields for CUDA/NPU, 3 for CPU (the storage inline, as torch.storage._load_from_bytes of
torch.save bytes); older examples send (rebuild_fn, args). Read with the allow-list below (inert stand-ins:
nothing the pickle names is called), checked against the declared tensor, then opened as rollbus's own
handles (engine.weights.ipc). Accepted only behind vLLM's opt-in, VLLM_ALLOW_INSECURE_SERIALIZATION.
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from engine.weights.ipc import (
    _B64_FIELDS,
    _REBUILD_FIELDS,
    _for_device,
    _int,
    _no_handle,
    _plain_device,
    _unb64,
)

INSECURE_SERIALIZATION_VAR = "VLLM_ALLOW_INSECURE_SERIALIZATION"
_MAX_HANDLE_BYTES = 1 << 20  # an IPC memory / event handle (64 bytes; expandable segments send more)
_PICKLED = "update_info.ipc_handles_pickled"


def insecure_serialization_allowed(environ: Any = None) -> bool:
    """vLLM's opt-in, read as vLLM reads it (``bool(int(os.getenv(VAR, "0")))``) from this process's
    environment, which the server's workers inherit from ``rollbus serve``."""
    value = (os.environ if environ is None else environ).get(INSECURE_SERIALIZATION_VAR, "0").strip() or "0"
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(f"{INSECURE_SERIALIZATION_VAR}={value!r} is not an integer (vLLM reads it with int(): "
                         "set it to 1 to accept pickled handles)") from None


class _Global:
    """An inert stand-in for an allowed global, shared across requests and so with no state a pickle could
    change: slots only, no __setattr__, BUILD (__setstate__) refused (a frozen slotted dataclass would accept
    one). A class may only be a value; a function's stand-in has `call`, which checks the arguments and
    returns inert data (torch's rebuild functions: the (function, args) pair, checked like any handle)."""

    __slots__ = ("name", "call")

    def __init__(self, name: str, call: Any = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "call", call)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __setstate__(self, state: Any) -> None:
        raise ValueError(f"{_PICKLED}: the pickle tries to set the state of {self.name}")

    def __reduce__(self) -> Any:  # never pickled back out
        raise TypeError("not picklable")

    def __eq__(self, other: object) -> bool:
        return type(other) is _Global and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.call is None:
            raise ValueError(f"{_PICKLED}: the pickle calls {self.name}, which is only allowed as a value")
        if kwargs:
            raise ValueError(f"{_PICKLED}: {self.name} called with keyword arguments")
        return self.call(self, args)


class _InlineStorage(bytes):
    """``torch.storage._load_from_bytes(blob)`` as the pickle asked for it; parsed by _parse_legacy_storage."""

    __slots__ = ()

    @property
    def blob(self) -> bytes:
        return bytes(self)


def _one(test: Any, make: Any, expects: str) -> Any:
    """A stand-in's `call`: one argument passing `test`, made into `make(argument)`."""
    def call(g: _Global, args: tuple[Any, ...]) -> Any:
        if len(args) != 1 or not test(args[0]):
            raise ValueError(f"{_PICKLED}: {g.name} expects {expects}")
        return make(args[0])
    return call


def _dims(v: Any) -> bool:
    return isinstance(v, tuple | list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)


TENSOR_DTYPES = {n: getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}
_CUDA_REBUILD, _NPU_REBUILD, _CPU_REBUILD = _REBUILDS = tuple(
    _Global(f"{package}.multiprocessing.reductions.rebuild_{what}", call=lambda g, args: (g, args))
    for package, what in (("torch", "cuda_tensor"), ("torch_npu", "npu_tensor"), ("torch", "tensor")))
_TENSOR_CLASSES = {_Global("torch.Tensor"), _Global("torch.nn.parameter.Parameter")}
_STORAGE_CLASSES = {f"torch.{p}{n}": n for p, n in (("storage.", "TypedStorage"), ("", "UntypedStorage"))}

# What ipc_handles_pickled may name, each mapped to what the unpickler hands the pickle instead.
PICKLED_HANDLE_GLOBALS: dict[tuple[str, str], Any] = {
    **{tuple(g.name.rsplit(".", 1)): g for g in (*_TENSOR_CLASSES, *_REBUILDS, *map(_Global, _STORAGE_CLASSES))},
    ("torch", "Size"): _Global("torch.Size", _one(_dims, tuple, "one sequence of non-negative ints")),
    ("torch.storage", "_load_from_bytes"): _Global("torch.storage._load_from_bytes", _one(
        lambda b: isinstance(b, bytes), _InlineStorage, "one bytes argument")),
    **{("torch", n): dt for n, dt in TENSOR_DTYPES.items()},
}

# torch.save's legacy storage classes (inside _load_from_bytes' blob) and their dtypes.
_LEGACY_DTYPES = {f"torch.{s}Storage": TENSOR_DTYPES[d] for s, d in (
    ("Float", "float32"), ("Half", "float16"), ("BFloat16", "bfloat16"), ("Double", "float64"), ("Byte", "uint8"),
    ("Char", "int8"), ("Short", "int16"), ("Int", "int32"), ("Long", "int64"), ("Bool", "bool"))}
_LEGACY_STORAGES = {tuple(n.split(".")): _Global(n) for n in _LEGACY_DTYPES}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_LEGACY_PROTOCOL = 1001


def _restricted(data: Any, what: str, allowed: Any = None, **kw: Any) -> Any:
    """safe_pickle.restricted_loads with every failure a ValueError naming `what`."""
    from engine.weights.safe_pickle import PLAIN_DATA, restricted_loads

    try:
        return restricted_loads(data, PLAIN_DATA if allowed is None else allowed, what=what, **kw)
    except ValueError:
        raise
    except Exception as e:  # UnpicklingError (UnsafePickleError), EOFError, TypeError from a bad opcode, ...
        raise ValueError(str(e) if what in str(e) else f"{what}: not a valid pickle: {type(e).__name__}: {e}") \
            from None


def load_pickled_handles(text: Any) -> Any:
    """Decode and unpickle ``ipc_handles_pickled`` through the restricted unpickler: the handle structure
    with stand-ins for torch's classes and functions. ValueError names a global off the allow-list."""
    if not isinstance(text, str):
        raise ValueError(f"{_PICKLED} must be base64 text, got {type(text).__name__}")
    return _restricted(_unb64(text, _PICKLED), _PICKLED, PICKLED_HANDLE_GLOBALS)


@dataclass(frozen=True)
class Expect:
    """What one handle must hold: a `dtype` tensor of `shape`, or (packed) a flat uint8 buffer of >= nbytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    packed: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def resolve_pickled_handle(entry: Any, expect: Expect, device: torch.device, where: str) -> Any:
    """One entry of the unpickled structure (``{device_key: args}``) -> what HandleImporter.open takes: a
    plain-data device handle for accelerator memory, or the bytes themselves (a flat uint8 CPU tensor) for a
    CPU trainer's inline storage. Every field is checked against `expect` first; nothing of torch's runs."""
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"{where}: expected a non-empty dict {{device_key: rebuild args}}, got "
                         f"{type(entry).__name__}")
    found = _for_device(entry, device)
    # Inline CPU bytes do not depend on where they were made: a single such entry serves any worker.
    values = list(entry.values())
    if found is None and len(values) == 1 and _inline(values[0]):
        found = (None, values[0])
    if found is None:
        raise ValueError(f"{where}: {_no_handle(entry, device)}")
    args, fn = found[1], None
    if isinstance(args, tuple) and len(args) == 2 and args[0] in _REBUILDS:
        fn, args = args
    if not isinstance(args, tuple | list):
        raise ValueError(f"{where}: rebuild args must be a tuple, got {type(args).__name__}")
    if len(args) == len(_REBUILD_FIELDS) and fn in (None, _CUDA_REBUILD, _NPU_REBUILD):
        kind = device.type
        if kind not in ("cuda", "npu"):
            raise ValueError(f"{where}: a CUDA/NPU IPC handle cannot be opened on a {kind} device (trainer and "
                             "engine must share the device kind)")
        if fn is not None and fn is not (_CUDA_REBUILD if kind == "cuda" else _NPU_REBUILD):
            raise ValueError(f"{where}: {fn.name} cannot rebuild a tensor on a {kind} device")
        return _device_handle_from_args(kind, dict(zip(_REBUILD_FIELDS, args)), expect, where)
    if len(args) == 3 and fn in (None, _CPU_REBUILD):
        return _inline_tensor_from_args(*args, expect=expect, where=where)
    raise ValueError(f"{where}: unknown rebuild args ({len(args)} fields{', for ' + fn.name if fn else ''}); "
                     "expected the 15 of rebuild_cuda_tensor or the 3 of rebuild_tensor (reduce_tensor's output)")


def _inline(v: Any) -> bool:
    return isinstance(v, tuple | list) and len(v) in (2, 3) and any(
        isinstance(x, _InlineStorage) or (isinstance(x, tuple) and any(isinstance(y, _InlineStorage) for y in x))
        for x in v)


def _check_layout(shape: Any, stride: Any, dtype: Any, expect: Expect, where: str) -> int:
    """The handle's tensor is the declared one, contiguous; returns its size in bytes."""
    for what, v in (("shape", shape), ("stride", stride)):
        if not _dims(v):
            raise ValueError(f"{where}: {what} must be a tuple of non-negative ints, got {v!r}")
    shape, stride = tuple(shape), tuple(stride)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: dtype field is not a torch dtype: {dtype!r}")
    if expect.packed:
        if dtype != torch.uint8 or len(shape) != 1:
            raise ValueError(f"{where}: a packed buffer must be a flat uint8 tensor, got {dtype} {list(shape)}")
        if shape[0] < expect.nbytes:
            raise ValueError(f"{where}: the packed buffer holds {shape[0]} bytes, the tensors need {expect.nbytes}")
    elif dtype != expect.dtype:
        raise ValueError(f"{where}: the handle holds {str(dtype)[6:]}, dtype_names says {str(expect.dtype)[6:]}")
    elif shape != expect.shape:
        raise ValueError(f"{where}: the handle's shape {list(shape)} is not the declared {list(expect.shape)}")
    want = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if len(stride) != len(shape) or any(s != w for s, w, d in zip(stride, want, shape) if d > 1):
        raise ValueError(f"{where}: the handle's tensor is not contiguous (stride {list(stride)})")
    return math.prod(shape) * dtype.itemsize


def _device_handle_from_args(kind: str, f: dict[str, Any], expect: Expect, where: str) -> dict[str, Any]:
    if f["tensor_cls"] not in _TENSOR_CLASSES:
        raise ValueError(f"{where}: tensor class must be torch.Tensor or Parameter, got {f['tensor_cls']!r}")
    storage_cls = _STORAGE_CLASSES.get(getattr(f["storage_cls"], "name", None))
    if storage_cls is None:
        raise ValueError(f"{where}: storage class must be TypedStorage or UntypedStorage, got {f['storage_cls']!r}")
    nbytes = _check_layout(f["shape"], f["stride"], f["dtype"], expect, where)
    offset = _int(f["tensor_offset"], f"{where}: tensor_offset", 0) * f["dtype"].itemsize
    size = _int(f["storage_size_bytes"], f"{where}: storage_size_bytes", 0)
    if offset + nbytes > size:
        raise ValueError(f"{where}: tensor bytes [{offset}, {offset + nbytes}) run past its storage ({size} bytes)")
    for name in _B64_FIELDS:
        v = f[name]
        if not (isinstance(v, bytes) and 0 < len(v) <= _MAX_HANDLE_BYTES or v is None and name == "event_handle"):
            raise ValueError(f"{where}: {name} must be non-empty bytes (at most {_MAX_HANDLE_BYTES}), got "
                             f"{type(v).__name__}")
    for name in ("requires_grad", "event_sync_required"):
        if not isinstance(f[name], bool):
            raise ValueError(f"{where}: {name} must be a boolean, got {f[name]!r}")
    for name in ("device", "storage_offset_bytes", "ref_counter_offset"):
        _int(f[name], f"{where}: {name}", 0)
    return _plain_device(kind, f, f["shape"][0] if expect.packed else nbytes, offset, storage_cls, expect.nbytes)


def _inline_tensor_from_args(cls: Any, storage: Any, meta: Any, *, expect: Expect, where: str) -> torch.Tensor:
    if cls not in _TENSOR_CLASSES:
        raise ValueError(f"{where}: tensor class must be torch.Tensor or Parameter, got {cls!r}")
    if not isinstance(storage, _InlineStorage):
        raise ValueError(f"{where}: a CPU tensor's storage must come as torch.storage._load_from_bytes (vLLM's "
                         f"plain pickle of reduce_tensor's args), got {type(storage).__name__}")
    if not isinstance(meta, tuple | list) or len(meta) != 4:
        raise ValueError(f"{where}: metadata must be (storage_offset, size, stride, requires_grad)")
    offset = _int(meta[0], f"{where}: storage_offset", 0)
    if not _dims(meta[1]):
        raise ValueError(f"{where}: size must be a tuple of non-negative ints, got {meta[1]!r}")
    if not isinstance(meta[3], bool):
        raise ValueError(f"{where}: requires_grad must be a boolean")
    # The declared tensor bounds the blob before any of it is parsed: its bytes plus torch.save's headers.
    dtype = torch.uint8 if expect.packed else expect.dtype
    limit = offset * dtype.itemsize + (math.prod(meta[1]) if expect.packed else expect.nbytes)
    if len(storage.blob) > limit + 4096:
        raise ValueError(f"{where}: the inline storage is {len(storage.blob)} bytes, more than the declared "
                         f"tensor needs ({limit})")
    sdtype, data = _parse_legacy_storage(storage.blob, where)
    nbytes = _check_layout(meta[1], meta[2], sdtype, expect, where)
    start = offset * sdtype.itemsize
    if start + nbytes > data.numel():
        raise ValueError(f"{where}: tensor bytes run past its inline storage ({data.numel()} bytes)")
    return data[start:start + expect.nbytes]


def _parse_legacy_storage(blob: bytes, where: str) -> tuple[torch.dtype, torch.Tensor]:
    """torch.save's legacy format of one storage (what ``_load_from_bytes`` would torch.load with
    weights_only=False), read without torch.load: five small pickles through the restricted unpickler, then
    the element count and the raw bytes. Returns (dtype, flat uint8 tensor over a copy of the bytes)."""
    what, found = f"{where} (inline storage)", []
    stream = io.BytesIO(blob)

    def persistent(pid: Any) -> str:
        found.append(pid)
        return "storage"

    magic, proto, info, main, keys = (_restricted(stream, what, _LEGACY_STORAGES if i == 3 else None,
                                                  persistent_load=persistent if i == 3 else None) for i in range(5))
    if magic != _LEGACY_MAGIC or proto != _LEGACY_PROTOCOL or not isinstance(info, dict):
        raise ValueError(f"{what}: not torch.save's legacy storage format")
    if info.get("little_endian") is not True:
        raise ValueError(f"{what}: big-endian storages are not supported")
    if main != "storage" or len(found) != 1:
        raise ValueError(f"{what}: expected exactly one storage")
    pid = found[0]
    if (not isinstance(pid, tuple) or len(pid) != 6 or pid[0] != "storage" or not isinstance(pid[1], _Global)
            or pid[1].name not in _LEGACY_DTYPES or pid[3] != "cpu" or pid[5] is not None):
        raise ValueError(f"{what}: unexpected storage record {pid!r}")
    dtype, numel, pos = _LEGACY_DTYPES[pid[1].name], _int(pid[4], f"{what}: element count", 0), stream.tell()
    if keys != [pid[2]]:
        raise ValueError(f"{what}: storage keys do not match")
    if len(blob) != pos + 8 + numel * dtype.itemsize:
        raise ValueError(f"{what}: {len(blob) - pos - 8} data bytes for {numel} {str(dtype)[6:]} elements")
    (count,) = struct.unpack_from("<q", blob, pos)
    if count != numel:
        raise ValueError(f"{what}: element count {count} disagrees with the storage record's {numel}")
    raw = bytearray(blob[pos + 8:])
    return dtype, torch.frombuffer(raw, dtype=torch.uint8) if numel else torch.empty(0, dtype=torch.uint8)
