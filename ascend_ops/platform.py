"""The platform layer: which device this process computes on, and the few device-specific calls.

Everything that differs between Ascend NPU (torch_npu), CUDA and CPU is answered here, so model, worker
and memory code stay device-agnostic. The CPU path is the one the tests exercise; the NPU and CUDA paths
use the same torch calls through their device modules.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ascend_ops.host_env import DEVICE_ENV, HUGETLB_TUNABLE, allocator_preloaded


@dataclass(frozen=True, slots=True)
class Platform:
    name: str  # "npu" | "cuda" | "cpu"
    device_type: str  # torch device type string
    dist_backend: str  # torch.distributed backend for collectives: hccl | nccl | gloo
    alloc_conf_env: str | None  # env var of the caching allocator's settings

    def device(self, index: int = 0) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        if self.name == "npu":
            return torch.npu.device_count()  # type: ignore[attr-defined]
        if self.name == "cuda":
            return torch.cuda.device_count()
        return 1

    def synchronize(self) -> None:
        if self.name == "npu":
            torch.npu.synchronize()  # type: ignore[attr-defined]
        elif self.name == "cuda":
            torch.cuda.synchronize()

    def free_memory_bytes(self, index: int = 0) -> int:
        """Free device memory; on CPU the host's available memory."""
        if self.name == "npu":
            free, _ = torch.npu.mem_get_info(index)  # type: ignore[attr-defined]
            return int(free)
        if self.name == "cuda":
            free, _ = torch.cuda.mem_get_info(index)
            return int(free)
        return _host_available_bytes()


def _proc_bytes(path: str, key: str) -> int | None:
    """A "Key:   N kB" line of a /proc file, in bytes (None where it is not there)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _host_available_bytes() -> int:
    got = _proc_bytes("/proc/meminfo", "MemAvailable")
    return got if got is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def host_total_bytes() -> int:
    """The host's total memory (MemTotal)."""
    got = _proc_bytes("/proc/meminfo", "MemTotal")
    return got if got is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_resident_bytes() -> int:
    """This process's resident memory now (VmRSS; where /proc has none, its peak)."""
    got = _proc_bytes("/proc/self/status", "VmRSS")
    if got is not None:
        return got
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


@functools.cache
def current_platform() -> Platform:
    """Pick NPU, then CUDA, then CPU. ROLLBUS_DEVICE=cpu|cuda|npu forces one."""
    forced = os.environ.get(DEVICE_ENV, "").lower()
    if forced == "npu" or (not forced and _npu_available()):
        return Platform("npu", "npu", "hccl", "PYTORCH_NPU_ALLOC_CONF")
    if forced == "cuda" or (not forced and torch.cuda.is_available()):
        return Platform("cuda", "cuda", "nccl", "PYTORCH_CUDA_ALLOC_CONF")
    return Platform("cpu", "cpu", "gloo", None)


def release_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise, so RSS would not drop after
    sleep on CPU). A no-op where malloc_trim does not exist."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# glibc's malloc: mallopt() parameters and the environment variables that set them before start.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
HOST_MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap, which is reused...
HOST_TRIM_THRESHOLD = 512 << 20  # ...and keeps up to this much free memory at its top between steps


@functools.cache
def tune_host_allocator() -> str:
    """Keep a CPU worker's step buffers in the process between steps; returns what is in use (each worker
    reports it in /server_info as `host_allocator`).

    glibc's malloc serves every block above its mmap threshold (128 KiB, raised as blocks are freed) from a
    fresh mapping and trims the heap's free top after each free, so a decode step's activations, logits and
    sampling buffers (a few MiB each) were page-faulted in anew on every step: measured on SmolLM2-135M, fp32,
    1 thread, 64 sequences: ~7,600 page faults per step, against ~0 with the two settings here, and the step
    ~10-15% faster. Blocks up to HOST_MMAP_THRESHOLD come from the heap, and up to HOST_TRIM_THRESHOLD of
    free heap stays mapped (sleep's malloc_trim still hands it all back). Left alone where the user chose: a
    MALLOC_*_ variable set, or tcmalloc / jemalloc / mimalloc in LD_PRELOAD (vLLM's CPU advice)."""
    if allocator_preloaded(os.environ):
        return f"LD_PRELOAD ({os.environ['LD_PRELOAD']})"
    user = [v for v in MALLOC_ENV if v in os.environ]
    if user:
        return f"glibc ({', '.join(user)} from the environment)"
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                   HOST_TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return "default (no glibc mallopt)"
    if not ok:
        return "glibc defaults (mallopt refused the settings)"
    return f"glibc (mmap threshold {HOST_MMAP_THRESHOLD >> 20} MiB, trim threshold {HOST_TRIM_THRESHOLD >> 20} MiB)"


def transparent_huge_pages() -> str | None:
    """The host's transparent huge page mode (always, madvise or never); None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def host_huge_pages() -> str:
    """How this process's host memory is paged (each CPU worker reports it in /server_info as
    `host_huge_pages`, after its weights are loaded): the malloc tunable in effect and how much of the
    process is on transparent huge pages now."""
    thp = transparent_huge_pages()
    if thp is None:
        return "unavailable (no transparent huge pages on this host)"
    huge = _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0
    tunable = next((t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith(HUGETLB_TUNABLE)),
                   None)
    how = f"glibc {tunable}" if tunable else "malloc on 4 KiB pages"
    return f"{how}, transparent huge pages '{thp}': {huge >> 20} MiB of the process on huge pages"


def releasable_host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor in its own anonymous mapping, so dropping it gives the memory straight
    back to the OS (no allocator cache, no heap fragmentation) and re-creating it costs page faults
    only, on first touch."""
    import mmap

    nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Huge pages where the kernel allows them (fewer faults). DONTFORK: a forked child gets no copy of it, and
    # its flags then differ from the allocator's mappings (which glibc.malloc.hugetlb=1 also marks for huge
    # pages), so the kernel never merges it with one: it stays a mapping of its own in /proc/<pid>/smaps.
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice):
            try:
                mm.madvise(getattr(mmap, advice))
            except OSError:
                pass
    # The tensor keeps the mapping alive; when the last view of it goes, the mapping is unmapped.
    return torch.frombuffer(mm, dtype=dtype, count=numel)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without writing to it


def populate_host_tensor(t: torch.Tensor) -> str:
    """Fault every page of a host tensor in now (its content is unchanged), so the steps that first write
    to its pages do not pay for them: the KV cache, whose fresh blocks otherwise fault huge pages in (with
    the kernel's compaction) in the middle of decode steps, one burst each time the sequences cross a block
    boundary (measured on SmolLM2-135M, fp32, 64 sequences: ~10% of decode time, steps up to 2x slower every
    16 tokens). Returns how: "madvise" (MADV_POPULATE_WRITE) or "write" (older kernels: zeros written over
    the zero-filled mapping)."""
    nbytes = t.numel() * t.element_size()
    if nbytes:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            start = t.data_ptr() & ~(os.sysconf("SC_PAGE_SIZE") - 1)
            length = t.data_ptr() + nbytes - start
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0:
                return "madvise"
        except (OSError, AttributeError):
            pass
        t.zero_()
    return "write"


COPY_PIECE_BYTES = 4 << 20  # a big contiguous copy is split into pieces of this size to spread over threads


class BulkCopier:
    """copy(dst, src) for a burst of host-memory copies (weight transfer: hundreds of tensors): queued, then
    run by flush() (and at the end of bulk_copy_threads) on one Python thread per intra-op thread, each
    copy_ single-threaded, big contiguous copies split into COPY_PIECE_BYTES pieces, the pieces dealt out by
    bytes. torch's own parallel copy is one parallel region per tensor: on a busy host each small region
    waits milliseconds for its spinning helpers (measured: 2.3 s against 94 ms for SmolLM2's 201 tensors on
    2 loaded cores), and a region per tensor leaves the other cores idle for every small one. A caller that
    reuses a source buffer must flush() before it does."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.queued = 0

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = dst.numel() * dst.element_size()
        if n > COPY_PIECE_BYTES and dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape:
            d, s = dst.reshape(-1), src.reshape(-1)
            step = max(1, COPY_PIECE_BYTES // dst.element_size())
            self.queue += [(d[i:i + step], s[i:i + step]) for i in range(0, d.numel(), step)]
        else:
            self.queue.append((dst, src))
        self.queued += n

    def discard(self) -> None:
        self.queue, self.queued = [], 0

    def flush(self) -> None:
        work, self.queue, queued, self.queued = self.queue, [], self.queued, 0
        if self.threads <= 1 or len(work) < 2 or queued < COPY_PIECE_BYTES:
            for dst, src in work:
                dst.copy_(src)
            return
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(self.threads)]
        loads = [0] * self.threads
        for dst, src in sorted(work, key=lambda w: -w[0].numel() * w[0].element_size()):
            i = loads.index(min(loads))
            shares[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()
        futures = [_copy_pool(self.threads - 1).submit(_run_copies, share) for share in shares[1:]]
        _run_copies(shares[0])
        for f in futures:
            f.result()


def _run_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)  # torch releases the GIL: the threads copy in parallel


@functools.cache
def _copy_pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="bulk-copy")


class _Immediate:
    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def flush(self) -> None:
        pass

    discard = flush


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block, then back to what they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def bulk_copy_threads() -> Iterator[BulkCopier | _Immediate]:
    """A BulkCopier for host memory (torch's intra-op threads set to 1 meanwhile: each of our threads copies
    alone); queued copies are done when the block ends without an exception. Accelerator copies run at
    once (copy_ on the current stream)."""
    if current_platform().name != "cpu":
        yield _Immediate()
        return
    copier = BulkCopier(torch.get_num_threads())
    with intra_op_threads(1):
        yield copier
        copier.flush()
