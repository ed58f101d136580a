"""Zero-pickle IPC handles for moving weights from a trainer process into the engine's workers.

A handle is plain data (str, int, bool, lists, dicts; bytes as base64 text), so it travels as JSON or
msgpack and the receiving side never unpickles anything. Two kinds:

- ``{"kind": "shm", "name", "offset", "nbytes", "size"}``: a named POSIX shared-memory segment under
  /dev/shm that a producer created with :class:`SharedBuffer` (CPU trainers; any worker on the same host).
- ``{"kind": "cuda" | "npu", ...}``: device memory of a CUDA / Ascend NPU tensor, from :func:`export_handle`.
  It carries the fields of torch's own IPC rebuild tuple (``torch.multiprocessing.reductions.reduce_tensor``,
  or torch_npu's patched version) with the classes dropped, bytes base64-encoded and the dtype by name.

Every handle selects ``nbytes`` bytes at ``offset`` of the exported memory; :meth:`HandleImporter.open`
returns exactly that range as a flat uint8 tensor. A producer with several devices sends a mapping
``{device_key: handle}``; each consumer picks its own entry with :func:`device_key`.

Only the CPU path runs in this repository's tests; the CUDA and NPU paths follow torch's and torch_npu's
IPC code (see the notes at :func:`export_handle`).
"""

from __future__ import annotations

import base64
import io
import itertools
import mmap
import os
import re
import socket
import stat
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ascend_ops.platform import current_platform

SHM_DIR = "/dev/shm"
SHM_PREFIX = "rollbus"
HANDLE_KINDS = ("shm", "cuda", "npu")
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.11 lacks the name
_counter = itertools.count()
_counter_lock = threading.Lock()

# The 15 arguments of torch's rebuild_cuda_tensor / torch_npu's rebuild_npu_tensor, in order.
_REBUILD_FIELDS = (
    "tensor_cls", "shape", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
    "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset",
    "event_handle", "event_sync_required",
)
_DEVICE_ARG = 6  # index of the device in the rebuild tuple; the consumer puts its own device there


# --- producer side: CPU shared memory --------------------------------------------------------------


def _unlink_quietly(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child exiting must not remove its parent's segment
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedBuffer:
    """A named shared-memory segment (/dev/shm/rollbus-<pid>-<n>) exposed as a flat uint8 tensor.

    The producer copies weights into ``tensor`` and sends ``handle(offset, nbytes)`` to the consumers.
    ``close()`` unlinks the name at once (consumers that already mapped it keep their mapping) and drops this
    object's mapping; the memory itself goes when the last tensor view of it goes (torch.frombuffer views do
    not pin the mapping, so unmapping under a live view would leave it dangling). The name is also unlinked
    when the object is garbage-collected or the interpreter exits; only a SIGKILLed producer leaks it.

    The memory is reserved up front (posix_fallocate: a full /dev/shm is an OSError here, not a SIGBUS on
    first write) and the page tables are populated (MADV_POPULATE_WRITE, else one write per page), so the
    first copy into the buffer runs at memcpy speed. ``prefault_s`` is what that cost.
    """

    def __init__(self, nbytes: int, *, prefault: bool = True) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"SharedBuffer size must be a positive number of bytes, got {nbytes!r}")
        self.size = nbytes
        fd, self.name = self._create()
        self.path = os.path.join(SHM_DIR, self.name)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path, os.getpid())
        try:
            t0 = time.perf_counter()
            if prefault:
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)
        self._mm: mmap.mmap | None = mm
        # The tensor holds a reference to the mmap object; the mapping is unmapped when both are gone.
        self._tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)
        self.prefault_method = "none"
        if prefault:
            self.prefault_method = _populate(mm, self._tensor)
        self.prefault_s = time.perf_counter() - t0

    @staticmethod
    def _create() -> tuple[int, str]:
        while True:  # a stale segment of a dead process with our pid: take the next number
            with _counter_lock:
                n = next(_counter)
            name = f"{SHM_PREFIX}-{os.getpid()}-{n}"
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            return fd, name

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"shared buffer {self.name} is closed")
        return self._tensor

    def handle(self, offset: int = 0, nbytes: int | None = None) -> dict[str, Any]:
        """Plain-data handle to ``nbytes`` bytes at ``offset`` (default: the rest of the buffer)."""
        if self.closed:
            raise ValueError(f"shared buffer {self.name} is closed")
        if nbytes is None:
            nbytes = self.size - offset
        _check_range(offset, nbytes, self.size, f"shared buffer {self.name}")
        return {"kind": "shm", "name": self.name, "offset": offset, "nbytes": nbytes, "size": self.size}

    def close(self) -> None:
        """Unlink the name and drop this object's mapping. Idempotent."""
        self._finalizer()
        self._tensor = None
        self._mm = None

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, size={self.size}{', closed' if self.closed else ''})"


def _populate(mm: mmap.mmap, tensor: torch.Tensor) -> str:
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)  # honoured only where shmem THP is "advise"/"always"
    except (OSError, AttributeError):
        pass
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return "madv_populate_write"
    except OSError:  # EINVAL before Linux 5.14
        tensor[:: mmap.PAGESIZE].zero_()  # one write per page; fallocate already zero-filled the memory
        return "touch"


def _check_int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return v


def _check_range(offset: Any, nbytes: Any, size: int, what: str) -> None:
    offset, nbytes = _check_int(offset, "handle offset"), _check_int(nbytes, "handle nbytes")
    if offset < 0 or nbytes < 0:
        raise ValueError(f"handle offset and nbytes must be >= 0, got offset={offset} nbytes={nbytes}")
    if offset + nbytes > size:
        raise ValueError(f"handle range [{offset}, {offset + nbytes}) runs past the end of {what} ({size} bytes)")


# --- producer side: accelerator memory ---------------------------------------------------------------


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: Any, what: str) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise ValueError(f"handle field {what} must be base64 text, got {type(s).__name__}")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except ValueError as e:
        raise ValueError(f"handle field {what} is not valid base64: {e}") from None


def export_handle(t: torch.Tensor) -> dict[str, Any]:
    """Plain-data IPC handle to a CUDA or NPU tensor's memory (producer side).

    The tensor must be contiguous; the handle exports it as a flat uint8 range (``offset`` 0, ``nbytes``
    t.nbytes) which a consumer may narrow by rewriting ``offset``/``nbytes``. Keep ``t`` alive until every
    consumer is done with it (torch's IPC ref counting keeps freed blocks in limbo, but reusing the memory for
    another tensor would change what the consumers read). Each call exports once: send each handle to ONE
    consumer, or export once per consumer, so torch's producer-side ref counter is released exactly once.

    Built from torch's own IPC machinery: ``torch.multiprocessing.reductions.reduce_tensor`` (CUDA:
    ``storage._share_cuda_()``; NPU: torch_npu replaces reduce_tensor with one built on ``_share_npu_()``
    whose 15-field tuple has the same layout and is rebuilt by ``torch_npu.multiprocessing.reductions.
    rebuild_npu_tensor``). Not runnable on this repository's CPU test machine.
    """
    kind = t.device.type
    if kind == "cpu":
        raise ValueError("export_handle is for CUDA/NPU tensors: copy a CPU tensor into an "
                         "engine.weights.ipc.SharedBuffer and send SharedBuffer.handle(offset, nbytes) instead")
    if kind not in ("cuda", "npu"):
        raise ValueError(f"no IPC handles for {kind} tensors (cuda and npu only)")
    if not t.is_contiguous():
        raise ValueError("export_handle needs a contiguous tensor (call .contiguous() first)")
    if kind == "npu":
        import torch_npu  # noqa: F401  (patches torch.multiprocessing.reductions.reduce_tensor for NPU tensors)
    from torch.multiprocessing import reductions

    flat = t.detach().reshape(-1).view(torch.uint8)
    rebuild, args = reductions.reduce_tensor(flat)  # looked up at call time: torch_npu's patch replaces it
    return _handle_from_reduction(kind, rebuild, args, device_key(t.device))


def _handle_from_reduction(kind: str, rebuild: Any, args: tuple[Any, ...], key: str) -> dict[str, Any]:
    """The plain-data form of torch's (rebuild function, 15-field tuple) for a flat uint8 tensor."""
    expected = "rebuild_cuda_tensor" if kind == "cuda" else "rebuild_npu_tensor"
    if getattr(rebuild, "__name__", "") != expected or len(args) != len(_REBUILD_FIELDS):
        raise RuntimeError(f"unexpected IPC reduction for a {kind} tensor: {getattr(rebuild, '__name__', rebuild)} "
                           f"with {len(args)} fields (this torch/torch_npu version changed its IPC tuple)")
    a = dict(zip(_REBUILD_FIELDS, args))
    if a["dtype"] != torch.uint8 or len(a["shape"]) != 1:
        raise RuntimeError(f"expected the reduction of a flat uint8 tensor, got {a['dtype']} {tuple(a['shape'])}")
    return {
        "kind": kind,
        "device_key": key,
        "device": int(a["device"]),
        "dtype": "uint8",
        "shape": [int(x) for x in a["shape"]],
        "stride": [int(x) for x in a["stride"]],
        "tensor_offset": int(a["tensor_offset"]),
        "storage_cls": a["storage_cls"].__name__,
        "handle": _b64(a["handle"]),
        "storage_size_bytes": int(a["storage_size_bytes"]),
        "storage_offset_bytes": int(a["storage_offset_bytes"]),
        "ref_counter_handle": _b64(a["ref_counter_handle"]),
        "ref_counter_offset": int(a["ref_counter_offset"]),
        "event_handle": _b64(a["event_handle"]),
        "event_sync_required": bool(a["event_sync_required"]),
        "offset": 0,
        "nbytes": int(a["shape"][0]),
    }


# --- device keys --------------------------------------------------------------------------------------


def _host_ip() -> str:
    """The address this host uses for outbound traffic (no packet is sent), else its name's address."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()


def _npu_physical_id(logical: int) -> int:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if not visible:
        return logical
    ids = [int(x) for x in visible.split(",") if x.strip()]
    if logical >= len(ids):
        raise ValueError(f"NPU {logical} is outside ASCEND_RT_VISIBLE_DEVICES={visible!r}")
    return ids[logical]


def device_key(device: torch.device | str | None = None) -> str:
    """This process's key in a multi-device handle mapping ``{device_key: handle}``.

    CUDA: the GPU's UUID (physical, so CUDA_VISIBLE_DEVICES remapping does not matter); NPU:
    ``"<host ip>-<physical chip id>"`` as vllm-ascend uses; CPU: the host name (shared memory is per host).
    """
    dev = torch.device(device) if device is not None else current_platform().device()
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return str(torch.cuda.get_device_properties(index).uuid)
    if dev.type == "npu":
        index = dev.index if dev.index is not None else torch.npu.current_device()  # type: ignore[attr-defined]
        return f"{_host_ip()}-{_npu_physical_id(index)}"
    return socket.gethostname()


# --- consumer side ------------------------------------------------------------------------------------


@dataclass
class _ShmMapping:
    inode: tuple[int, int]  # (st_dev, st_ino): a re-created segment under the same name is a new mapping
    tensor: torch.Tensor  # flat uint8 over the whole segment; holds the mmap object


@dataclass
class _DeviceImport:
    tensor: torch.Tensor  # flat uint8 over the whole exported tensor
    counters: set[tuple[bytes | None, int]] = field(default_factory=set)  # producer ref counters already seen


class HandleImporter:
    """Opens plain-data handles in a consumer process (one per worker) and caches the mappings.

    Shared memory is mapped read-only once per (name, size) and reused while the segment under that name is
    the same file, so repeated updates through the same producer buffers cost neither an mmap nor page
    faults. Device handles are rebuilt once per exported allocation. ``close()`` forgets every mapping (the
    memory goes when the last returned view goes).
    """

    def __init__(self) -> None:
        self._shm: dict[tuple[str, int], _ShmMapping] = {}
        self._dev: dict[tuple[Any, ...], _DeviceImport] = {}
        self.maps_created = 0  # shared-memory mmaps made so far (the cache is working when this stays put)
        self.imports_created = 0  # device rebuilds made so far

    def open(self, handle: Any, device: torch.device | str | None = None) -> torch.Tensor:
        """A flat uint8 tensor over exactly the handle's ``nbytes`` bytes at ``offset``.

        Shared-memory handles give a read-only host view whatever ``device`` is (copy it to the device);
        CUDA/NPU handles give a view on ``device`` (default: this platform's current device). A mapping
        ``{device_key: handle}`` is resolved with :func:`device_key` of ``device`` (then of the host, for
        shared memory). Raises ValueError for malformed, out-of-range or foreign handles.
        """
        h = self._select(handle, device)
        kind = h.get("kind")
        if kind == "shm":
            return self._open_shm(h)
        if kind in ("cuda", "npu"):
            return self._open_device(h, device)
        raise ValueError(f"unknown handle kind {kind!r}; known kinds: {', '.join(HANDLE_KINDS)}")

    def close(self) -> None:
        self._shm.clear()
        self._dev.clear()

    def prune(self) -> int:
        """Forget shared-memory mappings whose segment the producer has unlinked (or replaced), so a
        long-lived engine does not keep every departed trainer's buffers mapped. Returns how many."""
        gone = []
        for (name, size), m in self._shm.items():
            try:
                st = os.lstat(os.path.join(SHM_DIR, name))
                if (st.st_dev, st.st_ino) == m.inode:
                    continue
            except OSError:
                pass
            gone.append((name, size))
        for key in gone:
            del self._shm[key]
        return len(gone)

    def __enter__(self) -> HandleImporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers

    def _select(self, handle: Any, device: torch.device | str | None) -> dict[str, Any]:
        if not isinstance(handle, dict):
            raise ValueError(f"an IPC handle must be a JSON object, got {type(handle).__name__}")
        if "kind" in handle:
            return handle
        if not handle:
            raise ValueError("empty IPC handle mapping (expected {device_key: handle})")
        dev = torch.device(device) if device is not None else current_platform().device()
        keys = [device_key(dev)]
        if dev.type != "cpu":
            keys.append(device_key("cpu"))  # a host shared-memory handle serves any device on this host
        for k in keys:
            if k in handle:
                h = handle[k]
                if not isinstance(h, dict):
                    raise ValueError(f"the handle for device key {k!r} must be a JSON object")
                return h
        raise ValueError(f"no handle for this device (key {keys[0]!r}); available device keys: "
                         f"{sorted(map(str, handle))} (trainer and engine must share the host and device)")

    def _open_shm(self, h: dict[str, Any]) -> torch.Tensor:
        name = h.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
            raise ValueError(f"bad shared-memory name {name!r}: a plain file name under {SHM_DIR} is expected "
                             "(letters, digits, '_', '-', '.'; not starting with '.'; no '/' or '..')")
        size = _check_int(h.get("size"), "handle size")
        if size <= 0:
            raise ValueError(f"handle size must be positive, got {size}")
        offset, nbytes = h.get("offset"), h.get("nbytes")
        _check_range(offset, nbytes, size, f"shared-memory segment {name}")
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment {name!r} (the producer closed it or never made it)") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a shared-memory segment (not a regular file)")
        if st.st_size < size:
            raise ValueError(f"shared-memory segment {name!r} is {st.st_size} bytes, the handle says {size}")
        key = (name, size)
        m = self._shm.get(key)
        if m is None or m.inode != (st.st_dev, st.st_ino):
            m = self._map(path, name, size)
            self._shm[key] = m
        return m.tensor.narrow(0, offset, nbytes)

    def _map(self, path: str, name: str, size: int) -> _ShmMapping:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:  # gone since the stat, another user's segment (mode 0600), ...
            raise ValueError(f"cannot open shared-memory segment {name!r}: {e.strerror} (trainer and engine must "
                             "run as the same user on the same host)") from None
        try:
            st = os.fstat(fd)  # the file we actually map (the name may have been replaced since the stat)
            if st.st_size < size:
                raise ValueError(f"shared-memory segment {name!r} is {st.st_size} bytes, the handle says {size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.frombuffer(mm, dtype=torch.uint8)  # read-only memory: never write to these views
        self.maps_created += 1
        return _ShmMapping((st.st_dev, st.st_ino), t)

    def _open_device(self, h: dict[str, Any], device: torch.device | str | None) -> torch.Tensor:
        kind = h["kind"]
        plat = current_platform()
        dev = torch.device(device) if device is not None else plat.device()
        if dev.type != kind:
            raise ValueError(f"a {kind} IPC handle cannot be opened on a {dev.type} device "
                             "(trainer and engine must share the device kind; use shared memory from a CPU trainer)")
        missing = [f for f in ("shape", "stride", "tensor_offset", "dtype", "storage_cls", "handle",
                               "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
                               "ref_counter_offset", "event_sync_required", "offset", "nbytes") if f not in h]
        if missing:
            raise ValueError(f"{kind} IPC handle lacks {', '.join(missing)}")
        # export_handle always exports a flat uint8 tensor; accept nothing else.
        if h["dtype"] != "uint8" or h["stride"] != [1] or not isinstance(h["shape"], list) or len(h["shape"]) != 1:
            raise ValueError(f"{kind} IPC handle must describe a flat uint8 tensor (dtype 'uint8', one dimension, "
                             f"stride [1]), got dtype={h['dtype']!r} shape={h['shape']!r} stride={h['stride']!r}")
        total = _check_int(h["shape"][0], "handle shape")
        tensor_offset = _check_int(h["tensor_offset"], "handle tensor_offset")
        storage_size = _check_int(h["storage_size_bytes"], "handle storage_size_bytes")
        storage_offset = _check_int(h["storage_offset_bytes"], "handle storage_offset_bytes")
        counter_offset = _check_int(h["ref_counter_offset"], "handle ref_counter_offset")
        if min(total, tensor_offset, storage_size, storage_offset, counter_offset) < 0:
            raise ValueError(f"negative size or offset in {kind} IPC handle")
        if tensor_offset + total > storage_size:
            raise ValueError(f"{kind} IPC handle: tensor [{tensor_offset}, {tensor_offset + total}) runs past its "
                             f"storage ({storage_size} bytes)")
        _check_range(h["offset"], h["nbytes"], total, f"the exported {kind} tensor")
        if not isinstance(h["event_sync_required"], bool):
            raise ValueError(f"{kind} IPC handle: event_sync_required must be a boolean")
        storage_cls = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}.get(
            h["storage_cls"]) if isinstance(h["storage_cls"], str) else None
        if storage_cls is None:
            raise ValueError(f"unknown storage class {h['storage_cls']!r} in {kind} IPC handle")
        handle_bytes = _unb64(h["handle"], "handle")
        counter_bytes = _unb64(h["ref_counter_handle"], "ref_counter_handle")
        event_bytes = _unb64(h.get("event_handle"), "event_handle")
        _check_ref_counter(kind, counter_bytes, counter_offset)
        index = dev.index if dev.index is not None else _current_index(kind)
        ident = (kind, handle_bytes, storage_offset, tensor_offset, total)
        counter = (counter_bytes, counter_offset)
        imp = self._dev.get(ident)
        if imp is None or counter not in imp.counters:
            args: list[Any] = [
                torch.Tensor, (total,), (1,), tensor_offset, storage_cls, torch.uint8, h.get("device"),
                handle_bytes, storage_size, storage_offset, False, counter_bytes, counter_offset, event_bytes,
                h["event_sync_required"],
            ]
            args[_DEVICE_ARG] = index  # this worker's device, not the producer's index (as vLLM does)
            # A repeated export of an allocation we hold hits torch's shared_cache inside the rebuild, which
            # then only releases the producer's new ref counter; a handle re-sent as is (same counter) never
            # gets here, so the counter is not released twice (the over-release vllm-ascend warns about).
            t = _rebuild(kind)(*args).reshape(-1).view(torch.uint8)
            if imp is None:
                imp = _DeviceImport(t)
                self._dev[ident] = imp
                self.imports_created += 1
            imp.counters.add(counter)
        return imp.tensor.narrow(0, h["offset"], h["nbytes"])


def _check_ref_counter(kind: str, handle: bytes | None, offset: int) -> None:
    """torch's rebuild increments the int64 at `offset` of the producer's ref-counter file (a shared-memory
    segment it maps by name, CUDA_IPC_REF_COUNTER_FILE_SIZE slots) without a bounds check: check both here."""
    if not handle:
        raise ValueError(f"{kind} IPC handle: ref_counter_handle is empty")
    if offset >= CUDA_IPC_REF_COUNTER_FILE_SIZE:
        raise ValueError(f"{kind} IPC handle: ref_counter_offset {offset} is outside the ref-counter file "
                         f"({CUDA_IPC_REF_COUNTER_FILE_SIZE} slots)")
    if kind != "cuda":
        return  # torch_npu keeps its counters its own way; the offset bound is all we know of them
    try:
        name = handle.decode("ascii")
    except UnicodeDecodeError:
        name = ""
    if not name.startswith("/") or not _NAME_RE.fullmatch(name[1:]) or ".." in name:
        raise ValueError(f"{kind} IPC handle: ref_counter_handle {handle[:64]!r} is not a shared-memory name")
    try:
        st = os.lstat(os.path.join(SHM_DIR, name[1:]))
    except OSError:
        raise ValueError(f"{kind} IPC handle: no ref-counter segment {name!r} (the producer is gone, or not on "
                         "this host)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size < 8 * CUDA_IPC_REF_COUNTER_FILE_SIZE:
        raise ValueError(f"{kind} IPC handle: {name!r} is not a ref-counter segment")


def _current_index(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.current_device()
    return torch.npu.current_device()  # type: ignore[attr-defined]


def _rebuild(kind: str) -> Any:
    if kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor
    from torch_npu.multiprocessing.reductions import rebuild_npu_tensor  # type: ignore[import-not-found]

    return rebuild_npu_tensor


# --- vLLM's pickled handles (update_info.ipc_handles_pickled) -------------------------------------------
#
# vLLM's HTTP weight-sync client sends ``base64(pickle.dumps(ipc_handles))`` where ``ipc_handles`` is a list
# (one per tensor) of ``{device_key: args}``, or one such dict for a packed buffer, and ``args`` is the tuple
# ``torch.multiprocessing.reductions.reduce_tensor`` returns for the tensor: 15 fields for a CUDA tensor
# (rebuild_cuda_tensor's arguments; torch_npu's rebuild_npu_tensor has the same layout), 3 for a CPU tensor
# (rebuild_tensor's ``cls, storage, metadata``, where plain pickle writes the storage as
# ``torch.storage._load_from_bytes(<torch.save bytes>)``: the data itself, inline). Older examples send
# ``(rebuild_fn, args)`` pairs instead of bare args.
#
# The pickle is read by engine.weights.safe_pickle with the allow-list below, whose entries resolve to inert
# stand-ins: nothing the pickle names is called while it is read. Only afterwards, with every field checked
# against the tensor the update declares (dtype, shape, contiguity, byte ranges; the CUDA ref-counter slot and
# its shared-memory file), is the handle opened, by the same code as rollbus's own plain-data handles.

INSECURE_SERIALIZATION_VAR = "VLLM_ALLOW_INSECURE_SERIALIZATION"
CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000  # torch/csrc/CudaIPCTypes.h: int64 slots per producer ref-counter file
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
    """Inert stand-in for an allowed class global (calling it is refused). The stand-ins are shared across
    requests, so none has any state a pickle could change: slots only, no __setattr__, and a BUILD opcode
    (__setstate__) is refused (a frozen slotted dataclass would accept one)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __setstate__(self, state: Any) -> None:
        raise ValueError(f"{_PICKLED}: the pickle tries to set the state of {self.name}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self.name  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name))

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __reduce__(self) -> Any:  # never pickled back out
        raise TypeError("not picklable")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{_PICKLED}: the pickle calls {self.name}, which is only allowed as a value")


class _RebuildFn(_Global):
    """Stand-in for one of torch's rebuild functions: a pickle that calls it gets the (function, args) pair
    back, which is then checked like any other handle; the real function is only run after the checks."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"{_PICKLED}: {self.name} called with keyword arguments")
        return (self, args)


class _InlineStorage:
    """``torch.storage._load_from_bytes(blob)`` as the pickle asked for it; parsed by _parse_legacy_storage."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        object.__setattr__(self, "blob", blob)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __setstate__(self, state: Any) -> None:
        raise ValueError(f"{_PICKLED}: the pickle tries to set the state of an inline storage")


class _Builder:
    """A callable stand-in with no attributes a pickle could set (functions have a __dict__)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __setstate__(self, state: Any) -> None:
        raise ValueError(f"{_PICKLED}: the pickle tries to set the state of a stand-in")


def _load_from_bytes_fn(*args: Any) -> _InlineStorage:
    if len(args) != 1 or not isinstance(args[0], bytes):
        raise ValueError(f"{_PICKLED}: torch.storage._load_from_bytes expects one bytes argument")
    return _InlineStorage(args[0])


def _size_fn(*args: Any) -> tuple[int, ...]:
    if len(args) != 1 or not isinstance(args[0], tuple | list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in args[0]):
        raise ValueError(f"{_PICKLED}: torch.Size expects one sequence of non-negative ints")
    return tuple(args[0])


_load_from_bytes, _size = _Builder(_load_from_bytes_fn), _Builder(_size_fn)


TENSOR_DTYPES = {n: getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}
_CUDA_REBUILD = _RebuildFn("torch.multiprocessing.reductions.rebuild_cuda_tensor")
_NPU_REBUILD = _RebuildFn("torch_npu.multiprocessing.reductions.rebuild_npu_tensor")
_CPU_REBUILD = _RebuildFn("torch.multiprocessing.reductions.rebuild_tensor")
_TENSOR_CLASSES = {_Global("torch.Tensor"), _Global("torch.nn.parameter.Parameter")}
_STORAGE_CLASSES = {"torch.storage.TypedStorage": torch.storage.TypedStorage,
                    "torch.UntypedStorage": torch.UntypedStorage}

# What ipc_handles_pickled may name, each mapped to what the unpickler hands the pickle instead.
PICKLED_HANDLE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Tensor"): _Global("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Global("torch.nn.parameter.Parameter"),
    ("torch.storage", "TypedStorage"): _Global("torch.storage.TypedStorage"),
    ("torch", "UntypedStorage"): _Global("torch.UntypedStorage"),
    ("torch", "Size"): _size,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _CUDA_REBUILD,
    ("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"): _NPU_REBUILD,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _CPU_REBUILD,
    **{("torch", n): dt for n, dt in TENSOR_DTYPES.items()},
}

# torch.save's legacy storage classes (inside _load_from_bytes' blob), mapped to their dtypes.
_LEGACY_STORAGES: dict[tuple[str, str], Any] = {
    ("torch", name): _Global(f"torch.{name}") for name in (
        "FloatStorage", "HalfStorage", "BFloat16Storage", "DoubleStorage", "ByteStorage", "CharStorage",
        "ShortStorage", "IntStorage", "LongStorage", "BoolStorage")}
_LEGACY_DTYPES = {
    "torch.FloatStorage": torch.float32, "torch.HalfStorage": torch.float16, "torch.BFloat16Storage": torch.bfloat16,
    "torch.DoubleStorage": torch.float64, "torch.ByteStorage": torch.uint8, "torch.CharStorage": torch.int8,
    "torch.ShortStorage": torch.int16, "torch.IntStorage": torch.int32, "torch.LongStorage": torch.int64,
    "torch.BoolStorage": torch.bool}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_LEGACY_PROTOCOL = 1001


def load_pickled_handles(text: Any) -> Any:
    """Decode and unpickle ``ipc_handles_pickled`` through the restricted unpickler. Returns the handle
    structure with stand-ins in place of torch's classes and functions; raises ValueError (UnsafePickleError
    for a global off the allow-list, naming it)."""
    from engine.weights.safe_pickle import restricted_loads

    if not isinstance(text, str):
        raise ValueError(f"{_PICKLED} must be base64 text, got {type(text).__name__}")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{_PICKLED} is not valid base64: {e}") from None
    try:
        return restricted_loads(data, PICKLED_HANDLE_GLOBALS, what=_PICKLED)
    except ValueError:
        raise
    except Exception as e:  # UnpicklingError (UnsafePickleError), EOFError, TypeError from a bad opcode, ...
        raise ValueError(str(e) if _PICKLED in str(e) else f"{_PICKLED}: not a valid pickle: {type(e).__name__}: "
                         f"{e}") from None


@dataclass(frozen=True)
class Expect:
    """What one handle must hold: a tensor of `dtype` and `shape` (unpacked), or at least `nbytes` bytes of
    a flat uint8 buffer (packed)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    packed: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def resolve_pickled_handle(entry: Any, expect: Expect, device: torch.device, where: str) -> Any:
    """One entry of the unpickled structure (``{device_key: args}``) -> what HandleImporter.open takes: a
    plain-data device handle (``{"kind": "cuda"|"npu", ...}``) for accelerator memory, or the bytes
    themselves (a flat uint8 CPU tensor) for a CPU trainer's inline storage. Every field is checked against
    `expect` first; nothing of torch's runs here except reading the inline bytes."""
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"{where}: expected a non-empty dict {{device_key: rebuild args}}, got "
                         f"{type(entry).__name__}")
    args = _pick_entry(entry, device, where)
    fn = None
    if isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], _RebuildFn):
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
        return _device_handle_from_args(kind, list(args), expect, where)
    if len(args) == 3 and fn in (None, _CPU_REBUILD):
        return _inline_tensor_from_args(list(args), expect, where)
    raise ValueError(f"{where}: unknown rebuild args ({len(args)} fields{', for ' + fn.name if fn else ''}); "
                     "expected the 15 of rebuild_cuda_tensor or the 3 of rebuild_tensor (reduce_tensor's output)")


def _pick_entry(entry: dict, device: torch.device, where: str) -> Any:
    keys = [device_key(device)]
    if device.type != "cpu":
        keys.append(device_key("cpu"))
    for k in keys:
        if k in entry:
            return entry[k]
    values = list(entry.values())
    # Inline CPU bytes do not depend on where they were made: a single such entry serves any worker.
    if len(values) == 1 and isinstance(values[0], tuple | list) and len(values[0]) in (2, 3) and \
            any(isinstance(v, _InlineStorage) or (isinstance(v, tuple) and any(isinstance(x, _InlineStorage)
                for x in v)) for v in values[0]):
        return values[0]
    raise ValueError(f"{where}: no handle for this device (key {keys[0]!r}); available device keys: "
                     f"{sorted(map(str, entry))} (trainer and engine must share the host and device)")


def _int(v: Any, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{what} must be an integer >= {lo}, got {v!r}")
    return v


def _shape_of(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple | list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                 for d in v):
        raise ValueError(f"{what} must be a tuple of non-negative ints, got {v!r}")
    return tuple(v)


def _check_layout(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, expect: Expect,
                  where: str) -> int:
    """The handle's tensor is the declared one, contiguous; returns its size in bytes."""
    if expect.packed:
        if dtype != torch.uint8 or len(shape) != 1:
            raise ValueError(f"{where}: a packed buffer must be a flat uint8 tensor, got {dtype} {list(shape)}")
        if shape[0] < expect.nbytes:
            raise ValueError(f"{where}: the packed buffer holds {shape[0]} bytes, the tensors need {expect.nbytes}")
    else:
        if dtype != expect.dtype:
            raise ValueError(f"{where}: the handle holds {str(dtype)[6:]}, dtype_names says {str(expect.dtype)[6:]}")
        if shape != expect.shape:
            raise ValueError(f"{where}: the handle's shape {list(shape)} is not the declared {list(expect.shape)}")
    want, acc = [], 1
    for d in reversed(shape):
        want.append(acc)
        acc *= d
    if len(stride) != len(shape) or any(s != w for s, w, d in zip(stride, reversed(want), shape) if d > 1):
        raise ValueError(f"{where}: the handle's tensor is not contiguous (stride {list(stride)})")
    return acc * torch.empty(0, dtype=dtype).element_size()


def _device_handle_from_args(kind: str, a: list[Any], expect: Expect, where: str) -> dict[str, Any]:
    f = dict(zip(_REBUILD_FIELDS, a))
    if f["tensor_cls"] not in _TENSOR_CLASSES:
        raise ValueError(f"{where}: tensor class must be torch.Tensor or Parameter, got {f['tensor_cls']!r}")
    storage_cls = getattr(f["storage_cls"], "name", None)
    if storage_cls not in _STORAGE_CLASSES:
        raise ValueError(f"{where}: storage class must be TypedStorage or UntypedStorage, got {f['storage_cls']!r}")
    dtype = f["dtype"]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: dtype field is not a torch dtype: {dtype!r}")
    shape = _shape_of(f["shape"], f"{where}: shape")
    stride = _shape_of(f["stride"], f"{where}: stride")
    nbytes = _check_layout(shape, stride, dtype, expect, where)
    item = torch.empty(0, dtype=dtype).element_size()
    offset_bytes = _int(f["tensor_offset"], f"{where}: tensor_offset") * item
    storage_size = _int(f["storage_size_bytes"], f"{where}: storage_size_bytes")
    if offset_bytes + nbytes > storage_size:
        raise ValueError(f"{where}: tensor bytes [{offset_bytes}, {offset_bytes + nbytes}) run past its storage "
                         f"({storage_size} bytes)")
    for name in ("handle", "ref_counter_handle"):
        v = f[name]
        if not isinstance(v, bytes) or not 0 < len(v) <= _MAX_HANDLE_BYTES:
            raise ValueError(f"{where}: {name} must be non-empty bytes (at most {_MAX_HANDLE_BYTES}), got "
                             f"{type(v).__name__}")
    if f["event_handle"] is not None and (not isinstance(f["event_handle"], bytes)
                                          or len(f["event_handle"]) > _MAX_HANDLE_BYTES):
        raise ValueError(f"{where}: event_handle must be bytes or None")
    for name in ("requires_grad", "event_sync_required"):
        if not isinstance(f[name], bool):
            raise ValueError(f"{where}: {name} must be a boolean, got {f[name]!r}")
    if not isinstance(f["device"], int) or isinstance(f["device"], bool):
        raise ValueError(f"{where}: device must be an int index, got {f['device']!r}")
    return {
        "kind": kind, "device": f["device"], "dtype": "uint8", "shape": [nbytes if not expect.packed else shape[0]],
        "stride": [1], "tensor_offset": offset_bytes, "storage_cls": storage_cls.rsplit(".", 1)[-1],
        "handle": _b64(f["handle"]), "storage_size_bytes": storage_size,
        "storage_offset_bytes": _int(f["storage_offset_bytes"], f"{where}: storage_offset_bytes"),
        "ref_counter_handle": _b64(f["ref_counter_handle"]),
        "ref_counter_offset": _int(f["ref_counter_offset"], f"{where}: ref_counter_offset"),
        "event_handle": _b64(f["event_handle"]), "event_sync_required": f["event_sync_required"],
        "offset": 0, "nbytes": expect.nbytes,
    }


def _inline_tensor_from_args(a: list[Any], expect: Expect, where: str) -> torch.Tensor:
    cls, storage, meta = a
    if cls not in _TENSOR_CLASSES:
        raise ValueError(f"{where}: tensor class must be torch.Tensor or Parameter, got {cls!r}")
    if not isinstance(storage, _InlineStorage):
        raise ValueError(f"{where}: a CPU tensor's storage must come as torch.storage._load_from_bytes (vLLM's "
                         f"plain pickle of reduce_tensor's args), got {type(storage).__name__}")
    if not isinstance(meta, tuple | list) or len(meta) != 4:
        raise ValueError(f"{where}: metadata must be (storage_offset, size, stride, requires_grad)")
    offset = _int(meta[0], f"{where}: storage_offset")
    shape, stride = _shape_of(meta[1], f"{where}: size"), _shape_of(meta[2], f"{where}: stride")
    if not isinstance(meta[3], bool):
        raise ValueError(f"{where}: requires_grad must be a boolean")
    # The declared tensor bounds the blob before any of it is parsed: its bytes plus torch.save's headers.
    dtype = expect.dtype if not expect.packed else torch.uint8
    item = torch.empty(0, dtype=dtype).element_size()
    limit = (offset * item + (expect.nbytes if not expect.packed else _prod(shape))) + 4096
    if len(storage.blob) > limit:
        raise ValueError(f"{where}: the inline storage is {len(storage.blob)} bytes, more than the declared "
                         f"tensor needs ({limit - 4096})")
    sdtype, data = _parse_legacy_storage(storage.blob, where)
    nbytes = _check_layout(shape, stride, sdtype, expect, where)
    sitem = torch.empty(0, dtype=sdtype).element_size()
    if (offset * sitem) + nbytes > data.numel():
        raise ValueError(f"{where}: tensor bytes run past its inline storage ({data.numel()} bytes)")
    return data[offset * sitem: offset * sitem + expect.nbytes]


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_legacy_storage(blob: bytes, where: str) -> tuple[torch.dtype, torch.Tensor]:
    """torch.save's legacy format of one storage (what ``_load_from_bytes`` would torch.load with
    weights_only=False), read without torch.load: four small pickles through the restricted unpickler, then
    the element count and the raw bytes. Returns (dtype, flat uint8 tensor over a copy of the bytes)."""
    import pickletools
    import struct

    from engine.weights.safe_pickle import restricted_loads

    what = f"{where} (inline storage)"
    pos, parts = 0, []
    try:
        for _ in range(5):
            end = None
            stream = io.BytesIO(blob)
            stream.seek(pos)
            for op, _arg, at in pickletools.genops(stream):
                if op.name == "STOP":
                    end = at + 1
                    break
            if end is None:
                raise ValueError("truncated")
            parts.append(blob[pos:end])
            pos = end
    except ValueError as e:
        raise ValueError(f"{what}: not torch.save's storage format ({e})") from None
    found: list[tuple[Any, ...]] = []

    def persistent(pid: Any) -> Any:
        found.append(pid)
        return "storage"

    try:
        magic = restricted_loads(parts[0], what=what)
        proto = restricted_loads(parts[1], what=what)
        info = restricted_loads(parts[2], what=what)
        main = restricted_loads(parts[3], _LEGACY_STORAGES, what=what, persistent_load=persistent)
        keys = restricted_loads(parts[4], what=what)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(str(e) if what in str(e) else f"{what}: {type(e).__name__}: {e}") from None
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
    dtype = _LEGACY_DTYPES[pid[1].name]
    numel = _int(pid[4], f"{what}: element count")
    if keys != [pid[2]]:
        raise ValueError(f"{what}: storage keys do not match")
    item = torch.empty(0, dtype=dtype).element_size()
    if len(blob) != pos + 8 + numel * item:
        raise ValueError(f"{what}: {len(blob) - pos - 8} data bytes for {numel} {str(dtype)[6:]} elements")
    (count,) = struct.unpack_from("<q", blob, pos)
    if count != numel:
        raise ValueError(f"{what}: element count {count} disagrees with the storage record's {numel}")
    raw = bytearray(blob[pos + 8:])
    data = torch.frombuffer(raw, dtype=torch.uint8) if numel else torch.empty(0, dtype=torch.uint8)
    return dtype, data
