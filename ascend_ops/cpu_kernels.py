"""The CPU kernels in ascend_ops/csrc, compiled once per machine kind and cached (torch.utils.cpp_extension).

`ops()` returns torch.ops.rollbus_cpu once the extension is built and loaded, or None (with `unavailable()`
saying why) where it cannot be: no compiler or ninja, a failed build, or ROLLBUS_CPU_KERNELS=0
(ROLLBUS_CPU_KERNELS=portable builds the plain C++ loops only, =avx2 the AVX2 code without the AVX-512 code:
for tests). The first
process on a machine compiles (~a minute on 2 cores); every later one loads the cached library directly
(no subprocess). Several processes starting at once (a server's workers, a test run's servers) build it
once: the build runs under an exclusive flock on the build folder, which the OS drops if the builder dies,
so a killed build never leaves the others waiting (torch's own lock file would).

Where: $ROLLBUS_KERNEL_CACHE if set, else torch's extension folder ($TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions/py<ver>_cpu), in a folder named by a hash of the source, the compile flags, the
torch and Python versions; AVX2/FMA/F16C code is compiled (and its folder named so) only on CPUs that have all three,
AVX-512 code (F, BW, VL) only on CPUs that have all three, so a cache copied to an older CPU is never loaded
there.

  python -m ascend_ops.cpu_kernels     # build now (CI warms the cache this way), print where and what
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAMESPACE = "rollbus_cpu"
# one compile unit, in this order
SOURCES = ("cpu_attention.cpp", "cpu_elementwise.cpp", "cpu_prefill_attention.cpp", "cpu_sampling.cpp", "cpu_gemm.cpp",
           "cpu_panel_gemm.cpp", "cpu_lora.cpp")
CACHE_ENV = "ROLLBUS_KERNEL_CACHE"
ENABLE_ENV = "ROLLBUS_CPU_KERNELS"
CHOICES = ("0", "1", "avx2", "portable")
_reason: list[str] = []


def _source() -> str:
    here = Path(__file__).resolve().parent / "csrc"
    return "\n".join((here / s).read_text(encoding="utf-8") for s in SOURCES)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


AVX2 = ("avx2", "fma", "f16c")  # F16C: fp16 KV caches (every AVX2 CPU has it)
AVX512 = ("avx512f", "avx512bw", "avx512vl")


def cflags() -> list[str]:
    """-O3 and OpenMP, plus the widest vector code this CPU runs (ROLLBUS_CPU_KERNELS caps it: portable,
    avx2). -fopenmp is what makes at::parallel_for parallel: torch's CPU build uses OpenMP for it, and
    the header runs the loop serially in code compiled without _OPENMP (the kernels ran on one thread
    whatever torch.get_num_threads() said). The OpenMP runtime is torch's own: the extension's libgomp.so.1
    is the one libtorch_cpu already loaded (same soname), so both share one thread pool and its size."""
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]  # fp-contract off: a * b + c rounded twice, as torch
    cap = os.environ.get(ENABLE_ENV)
    have = cpu_flags()
    if cap != "portable" and all(f in have for f in AVX2):
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if cap != "avx2" and all(f in have for f in AVX512):
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
    return flags


def build_dir(source: str, flags: list[str]) -> Path:
    key = hashlib.sha256("\0".join([source, *flags, torch.__version__, sys.version]).encode()).hexdigest()[:16]
    root = os.environ.get(CACHE_ENV)
    if not root:
        from torch.utils.cpp_extension import _get_build_directory  # torch's folder; it creates it

        return Path(_get_build_directory(f"{NAMESPACE}_{key}", verbose=False))
    return Path(root) / f"{NAMESPACE}_{key}"


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not on it when a venv is not activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _build(source: str, flags: list[str], folder: Path, name: str) -> Path:
    from torch.utils.cpp_extension import load_inline

    lib = folder / f"{name}.so"
    done = folder / "complete"
    if done.exists() and lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
        if done.exists() and lib.exists():  # another process built it while we waited
            return lib
        (folder / "lock").unlink(missing_ok=True)  # torch's lock file, left by a builder that was killed
        _ninja_on_path()
        log.warning("compiling the CPU kernels into %s (once per machine; about a minute)", folder)
        load_inline(name, [source], extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                    is_python_module=False, no_implicit_headers=True)
        done.write_text(" ".join(flags) + "\n")
    return lib


@functools.cache
def ops():
    """torch.ops.rollbus_cpu, or None where the kernels cannot be used (`unavailable()` says why)."""
    value = os.environ.get(ENABLE_ENV) or "1"
    if value not in CHOICES:
        raise ValueError(f"{ENABLE_ENV} must be {', '.join(CHOICES[:-1])} or {CHOICES[-1]}, got {value!r}")
    if value == "0":
        _reason.append(f"{ENABLE_ENV}=0")
        return None
    try:
        source, flags = _source(), cflags()
        folder = build_dir(source, flags)
        name = folder.name
        lib = _build(source, flags, folder, name)
        if not hasattr(torch.ops, NAMESPACE) or not hasattr(getattr(torch.ops, NAMESPACE), "paged_attention_rows"):
            torch.ops.load_library(str(lib))
        return getattr(torch.ops, NAMESPACE)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path serves instead
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _reason.append(f"{type(e).__name__}: {first}")
        log.warning("CPU kernels unavailable, using the torch path instead: %s", _reason[-1])
        return None


def threads() -> dict[str, int | None]:
    """The threads torch's ops run on and the threads these kernels' parallel loops ran on just now (None
    where the kernels are unavailable): each CPU worker reports both in /server_info, and they are equal
    unless the library was built without OpenMP."""
    got = ops()
    n = torch.get_num_threads()
    return {"torch": n, "kernels": int(got.parallel_width(n)) if got is not None else None}


def unavailable() -> str | None:
    """Why ops() returned None (after it was called), else None."""
    return _reason[-1] if _reason else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    got = ops()
    print(f"{NAMESPACE}: {'loaded from ' + str(build_dir(_source(), cflags())) if got else unavailable()}")
    sys.exit(0 if got else 1)
