"""Weights on 4 KiB pages against weights on transparent huge pages, in one process: the layer GEMMs of a
decode step (q/k/v, o, gate/up, down of every layer, on oneDNN pre-packed weights as CPU workers multiply
them, one thread) on two copies of the model's weight shapes, timed alternately so that load from other
processes hits both alike. The second copy is moved onto huge pages after it is made (madvise
MADV_HUGEPAGE + MADV_COLLAPSE, Linux 6.1+); the first stays on 4 KiB pages. Why CPU workers run with
glibc.malloc.hugetlb=1 (docs/serving.md, "Host memory").

    python bench/huge_pages.py                    # the default model's shapes, 32 and 64 rows
    python bench/huge_pages.py --rows 16 32 64 128 --rounds 30
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_ops.platform import _proc_bytes, tune_host_allocator  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from workers.models.checkpoint import load_hf_config  # noqa: E402

_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
HUGE = 2 << 20


def heap_end() -> int:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                return int(line.split()[0].split("-")[1], 16)
    raise SystemExit("no [heap] mapping: this benchmark needs glibc's malloc")


def layer_shapes(cfg: dict) -> list[tuple[int, int]]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    return [((heads + 2 * kv) * d, hidden), (hidden, heads * d), (2 * cfg["intermediate_size"], hidden),
            (hidden, cfg["intermediate_size"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tune_host_allocator()  # as a CPU worker: the packed weights come from the heap
    cfg = load_hf_config(resolve_model(args.model, progress=True))
    shapes, layers = layer_shapes(cfg), cfg["num_hidden_layers"]
    mb = sum(o * i for o, i in shapes) * layers * 4 >> 20
    print(f"{args.model}: {layers} layers, {mb} MiB of fp32 layer weights per copy", file=sys.stderr)
    ops = torch.ops.mkldnn

    def copy() -> list[list[torch.Tensor]]:
        return [[ops._reorder_linear_weight(torch.randn(o, i)) for o, i in shapes] for _ in range(layers)]

    small = copy()
    start = heap_end()
    huge = copy()
    end = heap_end()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    a, b = (start + HUGE - 1) & ~(HUGE - 1), end & ~(HUGE - 1)
    before = _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0
    t0 = time.perf_counter()
    if libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE) != 0 or \
            libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_COLLAPSE) != 0:
        raise SystemExit(f"madvise failed (errno {ctypes.get_errno()}): MADV_COLLAPSE needs Linux 6.1+ and "
                         "transparent huge pages not 'never'")
    moved = (_proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0) - before
    print(f"second copy: {moved >> 20} MiB moved onto huge pages in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    rows_out = []
    for m in args.rows:
        xs = {i: torch.randn(m, i) for _, i in shapes}

        def step(ws: list[list[torch.Tensor]]) -> float:
            t = time.perf_counter()
            for layer in ws:
                for (_, i), w in zip(shapes, layer):
                    ops._linear_pointwise(xs[i], w, None, "none", [], "")
            return time.perf_counter() - t

        step(small), step(huge)
        times: dict[str, list[float]] = {"4k": [], "huge": []}
        for r in range(args.rounds):
            times["4k"].append(step(small))
            times["huge"].append(step(huge))
            print(f"\r{m} rows: round {r + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        ratio = statistics.median(a / b for a, b in zip(times["4k"], times["huge"]))
        flops = 2 * m * layers * sum(o * i for o, i in shapes)
        rows_out.append((m, statistics.median(times["4k"]), statistics.median(times["huge"]), ratio, flops))
    print("\n| rows | 4 KiB pages ms | huge pages ms | GFLOP/s 4 KiB / huge | speed-up (median of pairs) |")
    print("|------|----------------|---------------|----------------------|----------------------------|")
    for m, t4, th, ratio, flops in rows_out:
        print(f"| {m:4d} | {t4 * 1e3:14.1f} | {th * 1e3:13.1f} | {flops / t4 / 1e9:9.1f} / {flops / th / 1e9:<8.1f} | "
              f"{ratio:25.3f}x |")


if __name__ == "__main__":
    main()
