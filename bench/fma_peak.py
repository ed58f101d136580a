"""The CPU's fp32 FMA peak, measured: a register-only loop of independent fused multiply-adds on the widest
vectors the CPU has (AVX-512, else AVX2, else scalar), one thread per core at once. It is the physical limit
for any GEMM on this host (torch's large-GEMM rate, bench/gemm_ceiling.py, sits below it); benchmarks report an
engine's fraction of both.

    python bench/fma_peak.py        # GFLOP/s per core and in all, and the clock it implies
    python bench/fma_peak.py 1      # on one thread
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# ACC independent accumulators hide the FMA latency (4 cycles) on two FMA pipes; nothing touches memory
_SOURCE = r"""
typedef float vec __attribute__((vector_size(%(bytes)d)));
#define ACC(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define DECL(k) vec c##k = a * (float)(k + 1);
#define STEP(k) c##k = c##k * a + b;
#define SUM(k) s += c##k[0];
double fma_loop(long iters) {
    vec a, b;
    for (int i = 0; i < (int)(sizeof(vec) / 4); i++) { a[i] = 0.999999f; b[i] = 1e-7f; }
    ACC(DECL)
    for (long n = 0; n < iters; n++) { ACC(STEP) }
    double s = 0;
    ACC(SUM)
    return s;
}
"""
ACC = 16


def _flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def _build(avx512: bool = True) -> tuple[ctypes.CDLL, int]:
    """The loop compiled for the widest vectors here (gcc; `avx512=False`: at most AVX2): the library and its
    fp32 lanes."""
    flags = _flags()
    lanes, arch = ((16, "-mavx512f -mfma") if avx512 and "avx512f" in flags
                   else (8, "-mavx2 -mfma") if "fma" in flags else (4, ""))
    folder = Path(tempfile.mkdtemp(prefix="fma-peak-"))
    (folder / "fma.c").write_text(_SOURCE % {"bytes": lanes * 4})
    cmd = f"gcc -O2 -ffp-contract=fast {arch} -shared -fPIC -o {folder}/fma.so {folder}/fma.c"
    subprocess.run(cmd.split(), check=True)
    lib = ctypes.CDLL(str(folder / "fma.so"))
    lib.fma_loop.argtypes, lib.fma_loop.restype = [ctypes.c_long], ctypes.c_double
    return lib, lanes


def fma_peak(threads: int | None = None, seconds: float = 0.5, avx512: bool = True) -> dict:
    """fp32 FLOP/s of the FMA loop on `threads` threads at once (default: the cores this process may use), the
    best of three rounds of about `seconds` each; and the clock it implies with two FMA pipes per core.
    avx512=False: on AVX2 vectors even where the CPU has AVX-512 (the peak of an AVX2-only CPU at this clock)."""
    lib, lanes = _build(avx512)
    threads = threads or len(os.sched_getaffinity(0))
    iters = 1000
    while True:  # size a round to about `seconds` on one thread
        t = time.perf_counter()
        lib.fma_loop(iters)
        if time.perf_counter() - t > seconds / 4:
            break
        iters *= 4
    iters = int(iters * seconds / max(time.perf_counter() - t, 1e-6))
    best = 0.0
    for _ in range(3):
        ts = [threading.Thread(target=lib.fma_loop, args=(iters,)) for _ in range(threads)]  # ctypes drops the GIL
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = max(best, threads * iters * ACC * lanes * 2 / (time.perf_counter() - t))
    return {"flops": best, "threads": threads, "lanes": lanes, "clock_ghz": best / threads / (2 * 2 * lanes) / 1e9}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("threads", nargs="?", type=int, default=None,
                    help="threads to run the loop on at once (default: the cores this process may use)")
    r = fma_peak(ap.parse_args().threads)
    print(f"fp32 FMA peak: {r['flops'] / 1e9:.0f} GFLOP/s on {r['threads']} threads ({r['lanes']} lanes; "
          f"{r['flops'] / r['threads'] / 1e9:.0f} per core, i.e. {r['clock_ghz']:.2f} GHz with two FMA pipes)")
