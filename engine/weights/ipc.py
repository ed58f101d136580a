"""IPC handles that move weights from a trainer into the engine's workers on the same host.

rollbus's own handles are plain data (bytes as base64 text): ``{"kind": "shm", "name", "offset", "nbytes",
"size"}`` for a /dev/shm segment of a :class:`SharedBuffer` (CPU trainers), ``{"kind": "cuda" | "npu", ...}``
for device memory (:func:`export_handle`: torch's IPC rebuild tuple without the classes). Each selects
``nbytes`` bytes at ``offset``; :meth:`HandleImporter.open` returns that range as a flat uint8 tensor. A
mapping ``{device_key: handle}`` serves several devices. vLLM's pickled handles are read in
engine/weights/ipc_pickled.py. Only the CPU paths run in this repository's tests; the device paths follow
torch's and torch_npu's.

Lent segments (``SharedBuffer(n, lend=True)``, handles with ``"lend": true``): the trainer hands the bytes
over, so a worker may keep them as a parameter's memory instead of copying them (engine.weights.receiver).
Lifetime: the trainer creates and unlinks every segment (``close()``, at exit); a worker never unlinks, it
maps a lent segment read-write and sets byte ``rank`` of the segment's first page (LEND_HEADER) while any
tensor of that worker views it, clearing it when the last one goes (a commit that replaces the parameter,
an abort dropping its staging copy, a sleep, shutdown). The trainer writes into a lent segment again only
while every byte of that page is 0 (``held()`` False), else it takes another; a worker that died holding
one leaves it marked, so it is never reused. Unlinking does not take memory a worker still maps.
"""

from __future__ import annotations

import base64
import importlib
import itertools
import mmap
import os
import re
import socket
import stat
import time
import warnings
import weakref
from typing import Any

import torch

from ascend_ops.platform import current_platform

SHM_DIR = "/dev/shm"
SHM_PREFIX = "rollbus"
LEND_HEADER = 4096  # a lent segment's first page: one "held" byte per worker rank; the data follows
HANDLE_KINDS = ("shm", "cuda", "npu")
_NAME_RE = re.compile(r"(?!.*\.\.)[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")  # a plain file name, no ".." in it
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python 3.11 lacks the name
_counter = itertools.count()  # next() on it is atomic under the GIL
# The 15 arguments of torch's rebuild_cuda_tensor / torch_npu's rebuild_npu_tensor, in order.
_REBUILD_FIELDS = (
    "tensor_cls", "shape", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
    "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset",
    "event_handle", "event_sync_required",
)
_INT_FIELDS = ("tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_B64_FIELDS = ("handle", "ref_counter_handle", "event_handle")
_DEVICE_FIELDS = ("shape", "stride", "dtype", "storage_cls", "event_sync_required", "offset", "nbytes",
                  *_INT_FIELDS, *_B64_FIELDS[:2])
_STORAGES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000  # torch/csrc/CudaIPCTypes.h: int64 slots per producer ref-counter file


def _int(v: Any, what: str, lo: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
        raise ValueError(f"{what} must be an integer{'' if lo is None else f' >= {lo}'}, got {v!r}")
    return v


def _check_range(offset: Any, nbytes: Any, size: int, what: str) -> None:
    offset, nbytes = _int(offset, "handle offset"), _int(nbytes, "handle nbytes")
    if offset < 0 or nbytes < 0:
        raise ValueError(f"handle offset and nbytes must be >= 0, got offset={offset} nbytes={nbytes}")
    if offset + nbytes > size:
        raise ValueError(f"handle range [{offset}, {offset + nbytes}) runs past the end of {what} ({size} bytes)")


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: Any, what: str) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise ValueError(f"{what} must be base64 text, got {type(s).__name__}")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{what} is not valid base64: {e}") from None


# --- producer side ------------------------------------------------------------------------------------


def _unlink_quietly(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # a forked child exiting must not remove its parent's segment
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SharedBuffer:
    """A named shared-memory segment (/dev/shm/rollbus-<pid>-<n>) exposed as a flat uint8 tensor.

    The producer copies weights into ``tensor`` and sends ``handle(offset, nbytes)``. ``close()`` unlinks the
    name (consumers keep what they mapped) and drops this object's mapping; the memory goes with the last
    tensor view of it. The name is also unlinked on garbage collection and at interpreter exit. The memory is
    reserved up front (posix_fallocate: a full /dev/shm is an OSError here, not a SIGBUS later) and its page
    tables populated, so the first copy in runs at memcpy speed; ``prefault_s`` is what that cost.
    """

    def __init__(self, nbytes: int, *, prefault: bool = True, lend: bool = False) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"SharedBuffer size must be a positive number of bytes, got {nbytes!r}")
        self.size, self._base = nbytes, LEND_HEADER if lend else 0
        while True:  # a stale segment of a dead process with our pid: take the next number
            self.name = f"{SHM_PREFIX}-{os.getpid()}-{next(_counter)}"
            self.path = f"{SHM_DIR}/{self.name}"
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path, os.getpid())
        t0 = time.perf_counter()
        try:
            total = self._base + nbytes
            (os.posix_fallocate if prefault else lambda fd, _, n: os.ftruncate(fd, n))(fd, 0, total)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)
        # The tensor holds the mmap object; the mapping goes when both are gone.
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        self.prefault_method = _populate(mm, whole) if prefault else "none"
        self.prefault_s = time.perf_counter() - t0
        self._header, self._tensor = whole[:self._base], whole[self._base:]

    def held(self) -> bool:
        """A lent segment some worker still views (module docstring): not to be written."""
        return bool(self._header.any())

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
        self.tensor  # noqa: B018  (raises when closed)
        nbytes = self.size - offset if nbytes is None else nbytes
        _check_range(offset, nbytes, self.size, f"shared buffer {self.name}")
        h = {"kind": "shm", "name": self.name, "offset": self._base + offset, "nbytes": nbytes,
             "size": self._base + self.size}
        return {**h, "lend": True} if self._base else h

    def close(self) -> None:
        """Unlink the name and drop this object's mapping. Idempotent."""
        self._finalizer()
        self._tensor = self._header = None

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def export_handle(t: torch.Tensor) -> dict[str, Any]:
    """Plain-data IPC handle to a contiguous CUDA or NPU tensor's memory, as a flat uint8 range (a consumer
    may narrow ``offset``/``nbytes``). Keep ``t`` alive (and its memory unchanged) until every consumer is
    done; export once per consumer, so torch's producer-side ref counter is released exactly once. Built on
    ``torch.multiprocessing.reductions.reduce_tensor`` (torch_npu patches it with its ``_share_npu_()``)."""
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

    rebuild, args = reductions.reduce_tensor(t.detach().reshape(-1).view(torch.uint8))  # looked up now: patched
    return _handle_from_reduction(kind, rebuild, args, device_key(t.device))


def _handle_from_reduction(kind: str, rebuild: Any, args: tuple[Any, ...], key: str) -> dict[str, Any]:
    """The plain-data form of torch's (rebuild function, 15-field tuple) for a flat uint8 tensor."""
    name = getattr(rebuild, "__name__", rebuild)
    if name != f"rebuild_{kind}_tensor" or len(args) != len(_REBUILD_FIELDS):
        raise RuntimeError(f"unexpected IPC reduction for a {kind} tensor: {name} with {len(args)} fields "
                           "(this torch/torch_npu version changed its IPC tuple)")
    a = dict(zip(_REBUILD_FIELDS, args))
    if a["dtype"] != torch.uint8 or len(a["shape"]) != 1:
        raise RuntimeError(f"expected the reduction of a flat uint8 tensor, got {a['dtype']} {tuple(a['shape'])}")
    n = int(a["shape"][0])
    return {**_plain_device(kind, a, n, int(a["tensor_offset"]), a["storage_cls"].__name__, n), "device_key": key}


def _plain_device(kind: str, a: dict[str, Any], total: int, tensor_offset: int, storage_cls: str,
                  nbytes: int) -> dict[str, Any]:
    """A device handle as plain data: a flat uint8 tensor of `total` bytes at `tensor_offset` of its storage."""
    return {"kind": kind, "device": a["device"], "dtype": "uint8", "shape": [total], "stride": [1],
            "storage_cls": storage_cls, "event_sync_required": a["event_sync_required"],
            **{f: a[f] for f in _INT_FIELDS}, "tensor_offset": tensor_offset,
            **{f: _b64(a[f]) for f in _B64_FIELDS}, "offset": 0, "nbytes": nbytes}


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


def device_key(device: torch.device | str | None = None) -> str:
    """This process's key in a handle mapping ``{device_key: handle}``. CUDA: the GPU's UUID (physical, so
    CUDA_VISIBLE_DEVICES does not matter); NPU: ``"<host ip>-<physical chip id>"`` as vllm-ascend uses;
    CPU: the host name (shared memory is per host)."""
    dev = torch.device(device) if device is not None else current_platform().device()
    if dev.type == "cuda":
        return str(torch.cuda.get_device_properties(_index(dev)).uuid)
    if dev.type != "npu":
        return socket.gethostname()
    index, visible = _index(dev), os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    ids = [int(x) for x in visible.split(",") if x.strip()] if visible else None
    if ids is not None and index >= len(ids):
        raise ValueError(f"NPU {index} is outside ASCEND_RT_VISIBLE_DEVICES={visible!r}")
    return f"{_host_ip()}-{ids[index] if ids is not None else index}"


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else getattr(torch, dev.type).current_device()


def _for_device(mapping: dict, dev: torch.device) -> tuple[str, Any] | None:
    """The (key, entry) of a {device_key: handle} mapping for `dev` (a host entry serves any device here)."""
    for k in [device_key(dev)] + ([device_key("cpu")] if dev.type != "cpu" else []):
        if k in mapping:
            return k, mapping[k]
    return None


def _no_handle(mapping: dict, dev: torch.device) -> ValueError:
    return ValueError(f"no handle for this device (key {device_key(dev)!r}); available device keys: "
                      f"{sorted(map(str, mapping))} (trainer and engine must share the host and device)")


# --- consumer side ------------------------------------------------------------------------------------


class HandleImporter:
    """Opens handles in a consumer process (one per worker) and caches the mappings: a shared-memory segment
    is mapped read-only once per (name, size) while the file under that name is the same, so repeated updates
    through the same producer buffers cost neither an mmap nor page faults; a device allocation is rebuilt
    once. ``close()`` forgets every mapping (the memory goes when the last returned view goes)."""

    def __init__(self) -> None:
        # (name, size, lent) -> ((st_dev, st_ino), flat view, mmap); lent segments are mapped read-write
        self._shm: dict[tuple[str, int, bool], tuple[tuple[int, int], torch.Tensor, mmap.mmap]] = {}
        self._held: dict[tuple[str, int, bool], weakref.ref] = {}  # lent -> the memoryview our views hold
        self._dev: dict[tuple[Any, ...], tuple[torch.Tensor, set]] = {}  # -> (flat view, ref counters seen)
        self.maps_created = 0  # shared-memory mmaps made so far (the cache works when this stays put)
        self.imports_created = 0  # device rebuilds made so far

    def open(self, handle: Any, device: torch.device | str | None = None, rank: int | None = None) -> torch.Tensor:
        """A flat uint8 tensor over exactly the handle's ``nbytes`` bytes at ``offset``: a read-only host view
        for shared memory (whatever ``device``; with ``rank``, a lent segment's view is writable and marks
        the segment held by ``rank`` while it lives), a view on ``device`` (default: the platform's) for CUDA/NPU.
        A mapping ``{device_key: handle}`` is resolved by ``device``'s key, then the host's. Raises ValueError
        for malformed, out-of-range or foreign handles."""
        if not isinstance(handle, dict):
            raise ValueError(f"an IPC handle must be a JSON object, got {type(handle).__name__}")
        dev = torch.device(device) if device is not None else current_platform().device()
        if "kind" not in handle:
            if not handle:
                raise ValueError("empty IPC handle mapping (expected {device_key: handle})")
            key, h = _for_device(handle, dev) or (None, None)
            if key is None:
                raise _no_handle(handle, dev)
            if not isinstance(h, dict):
                raise ValueError(f"the handle for device key {key!r} must be a JSON object")
            handle = h
        kind = handle.get("kind")
        if kind == "shm":
            return self._open_shm(handle, rank)
        if kind in ("cuda", "npu"):
            return self._open_device(handle, dev)
        raise ValueError(f"unknown handle kind {kind!r}; known kinds: {', '.join(HANDLE_KINDS)}")

    def close(self) -> None:
        self._shm.clear()
        self._held.clear()
        self._dev.clear()

    def prune(self) -> int:
        """Forget mappings of segments the producer has unlinked (or replaced), so a long-lived engine does
        not keep every departed trainer's buffers mapped. Returns how many."""
        gone = [key for key, (inode, *_) in self._shm.items() if _inode(f"{SHM_DIR}/{key[0]}") != inode]
        for key in gone:
            del self._shm[key]
            self._held.pop(key, None)
        return len(gone)

    def _open_shm(self, h: dict[str, Any], rank: int | None) -> torch.Tensor:
        name = h.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"bad shared-memory name {name!r}: a plain file name under {SHM_DIR} is expected "
                             "(letters, digits, '_', '-', '.'; not starting with '.'; no '/' or '..')")
        size = _int(h.get("size"), "handle size")
        if size <= 0:
            raise ValueError(f"handle size must be positive, got {size}")
        _check_range(h.get("offset"), h.get("nbytes"), size, f"shared-memory segment {name}")
        path = f"{SHM_DIR}/{name}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment {name!r} (the producer closed it or never made it)") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a shared-memory segment (not a regular file)")
        _check_size(st, size, name)
        if h.get("lend") is True and h["offset"] < LEND_HEADER:
            raise ValueError(f"a lent segment's bytes start after its first {LEND_HEADER} (the holders' page)")
        lent = h.get("lend") is True and rank is not None and 0 <= rank < LEND_HEADER
        key = (name, size, lent)
        cached = self._shm.get(key)
        if cached is None or cached[0] != (st.st_dev, st.st_ino):
            cached = self._shm[key] = self._map(path, name, size, lent)
            self._held.pop(key, None)
        return (self._hold(key, cached[2], rank) if lent else cached[1]).narrow(0, h["offset"], h["nbytes"])

    def lent(self) -> set[int]:
        """Addresses of the lent segments our views hold (a view's untyped_storage().data_ptr())."""
        return {self._shm[k][1].data_ptr() for k, ref in self._held.items() if ref() is not None and k in self._shm}

    def _hold(self, key: tuple[str, int, bool], mm: mmap.mmap, rank: int) -> torch.Tensor:
        """The whole lent segment through one memoryview per holding: every view of it keeps the memoryview,
        whose end clears our byte of the header (module docstring)."""
        mv = self._held[key]() if key in self._held else None
        if mv is None:
            mv = memoryview(mm)
            mm[rank] = 1
            weakref.finalize(mv, mm.__setitem__, rank, 0)
            self._held[key] = weakref.ref(mv)
        return torch.frombuffer(mv, dtype=torch.uint8)

    def _map(self, path: str, name: str, size: int, rw: bool) -> tuple[tuple[int, int], torch.Tensor, mmap.mmap]:
        try:
            fd = os.open(path, (os.O_RDWR if rw else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:  # gone since the stat, another user's segment (mode 0600), ...
            raise ValueError(f"cannot open shared-memory segment {name!r}: {e.strerror} (trainer and engine must "
                             "run as the same user on the same host)") from None
        try:
            st = os.fstat(fd)  # the file we actually map (the name may have been replaced since the stat)
            _check_size(st, size, name)
            # MAP_POPULATE: the page tables are filled now, not one fault per page in the first copy out
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | (mmap.PROT_WRITE if rw else 0))
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.frombuffer(mm, dtype=torch.uint8)  # read-only memory unless lent: never write to these
        self.maps_created += 1
        return (st.st_dev, st.st_ino), t, mm

    def _open_device(self, h: dict[str, Any], dev: torch.device) -> torch.Tensor:
        kind = h["kind"]
        if dev.type != kind:
            raise ValueError(f"a {kind} IPC handle cannot be opened on a {dev.type} device "
                             "(trainer and engine must share the device kind; use shared memory from a CPU trainer)")
        a = check_device_handle(h)
        ident = (kind, a["handle"], a["storage_offset_bytes"], a["tensor_offset"], a["total"])
        counter = (a["ref_counter_handle"], a["ref_counter_offset"])
        imp = self._dev.get(ident)
        if imp is None or counter not in imp[1]:
            # A repeated export of an allocation we hold hits torch's shared_cache inside the rebuild, which then
            # only releases the producer's new ref counter; a handle re-sent as is (same counter) never gets
            # here, so the counter is not released twice (the over-release vllm-ascend warns about).
            args = [torch.Tensor, (a["total"],), (1,), a["tensor_offset"], _STORAGES[h["storage_cls"]], torch.uint8,
                    _index(dev), a["handle"], a["storage_size_bytes"], a["storage_offset_bytes"], False,
                    a["ref_counter_handle"], a["ref_counter_offset"], a["event_handle"], h["event_sync_required"]]
            t = _rebuild(kind)(*args).reshape(-1).view(torch.uint8)  # this worker's device index, as vLLM
            if imp is None:
                imp = self._dev[ident] = (t, set())
                self.imports_created += 1
            imp[1].add(counter)
        return imp[0].narrow(0, h["offset"], h["nbytes"])


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _check_size(st: os.stat_result, size: int, name: str) -> None:
    if st.st_size < size:
        raise ValueError(f"shared-memory segment {name!r} is {st.st_size} bytes, the handle says {size}")


def check_device_handle(h: dict[str, Any]) -> dict[str, Any]:
    """Every field of a plain-data CUDA/NPU handle checked (types, ranges, the ref-counter slot torch's rebuild
    writes to); returns the ints and the decoded bytes, plus "total" (the exported tensor's bytes)."""
    kind = h["kind"]
    missing = [f for f in _DEVICE_FIELDS if f not in h]
    if missing:
        raise ValueError(f"{kind} IPC handle lacks {', '.join(missing)}")
    if h["dtype"] != "uint8" or h["stride"] != [1] or not isinstance(h["shape"], list) or len(h["shape"]) != 1:
        raise ValueError(f"{kind} IPC handle must describe a flat uint8 tensor (dtype 'uint8', one dimension, "
                         f"stride [1]), got dtype={h['dtype']!r} shape={h['shape']!r} stride={h['stride']!r}")
    a = {f: _int(h[f], f"{kind} IPC handle {f}", 0) for f in _INT_FIELDS}
    a["total"] = total = _int(h["shape"][0], f"{kind} IPC handle shape", 0)
    if a["tensor_offset"] + total > a["storage_size_bytes"]:
        raise ValueError(f"{kind} IPC handle: tensor [{a['tensor_offset']}, {a['tensor_offset'] + total}) runs past "
                         f"its storage ({a['storage_size_bytes']} bytes)")
    _check_range(h["offset"], h["nbytes"], total, f"the exported {kind} tensor")
    if not isinstance(h["event_sync_required"], bool):
        raise ValueError(f"{kind} IPC handle: event_sync_required must be a boolean")
    if not isinstance(h["storage_cls"], str) or h["storage_cls"] not in _STORAGES:
        raise ValueError(f"unknown storage class {h['storage_cls']!r} in {kind} IPC handle")
    a.update({f: _unb64(h.get(f), f"handle field {f}") for f in _B64_FIELDS})
    # torch's rebuild increments the int64 at ref_counter_offset of the producer's ref-counter file (a
    # shared-memory segment it maps by name) without a bounds check: check both here.
    counter, offset = a["ref_counter_handle"], a["ref_counter_offset"]
    if not counter:
        raise ValueError(f"{kind} IPC handle: ref_counter_handle is empty")
    if offset >= CUDA_IPC_REF_COUNTER_FILE_SIZE:
        raise ValueError(f"{kind} IPC handle: ref_counter_offset {offset} is outside the ref-counter file "
                         f"({CUDA_IPC_REF_COUNTER_FILE_SIZE} slots)")
    if kind == "cuda":  # torch_npu keeps its counters its own way; the offset bound is all we know of them
        name = counter.decode("ascii", "replace")
        if not name.startswith("/") or not _NAME_RE.fullmatch(name[1:]):
            raise ValueError(f"{kind} IPC handle: ref_counter_handle {counter[:64]!r} is not a shared-memory name")
        try:
            st = os.lstat(f"{SHM_DIR}{name}")
        except OSError:
            raise ValueError(f"{kind} IPC handle: no ref-counter segment {name!r} (the producer is gone, or not on "
                             "this host)") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size < 8 * CUDA_IPC_REF_COUNTER_FILE_SIZE:
            raise ValueError(f"{kind} IPC handle: {name!r} is not a ref-counter segment")
    return a


def _rebuild(kind: str) -> Any:
    """torch's rebuild_cuda_tensor or torch_npu's rebuild_npu_tensor."""
    package = "torch" if kind == "cuda" else "torch_npu"
    return getattr(importlib.import_module(f"{package}.multiprocessing.reductions"), f"rebuild_{kind}_tensor")
