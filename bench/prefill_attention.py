"""The chunk attention kernel's arithmetic rate (ascend_ops/csrc/cpu_prefill_attention.cpp, what default mode runs
for prefill chunks on CPU) beside the large-GEMM rate of the same run (bench/gemm_ceiling.py: the rate workload L's
prefill ceiling assumes for every FLOP, attention's included). One causal chunk of --rows rows after --first cached
positions, over a paged fp32 cache whose blocks lie at random places; FLOPs counted as the ceiling counts them
(4 x query heads x head_dim per key a row attends to).

  python bench/prefill_attention.py --threads 2
  python bench/prefill_attention.py --threads 1 --shapes smollm2 --cases 0:2048 1500:256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's bench/

from ascend_ops import cpu_kernels  # noqa: E402
from bench.gemm_ceiling import Shape, gemm_rate  # noqa: E402
from bench.model_shapes import SHAPES  # noqa: E402

BS = 16


def shape(name: str) -> Shape:
    """smollm2: the default model's own config.json; else a bench/model_shapes.py shape."""
    if name == "smollm2":
        from engine.model_store import resolve_model

        return Shape.from_folder(resolve_model(None, progress=False))
    return Shape.from_config(SHAPES[name])


def rate(ops, hq: int, hk: int, d: int, first: int, rows: int, reps: int, g: torch.Generator) -> float:
    nblk = (first + rows + BS - 1) // BS
    kc, vc = (torch.randn(nblk, BS, hk, d, generator=g) for _ in range(2))
    table = torch.randperm(nblk, generator=g)
    q = torch.randn(rows, hq, d, generator=g)
    out = torch.empty_like(q)
    ops.prefill_attention(out, q, kc, vc, table, first, d ** -0.5, 0)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        ops.prefill_attention(out, q, kc, vc, table, first, d ** -0.5, 0)
        best = min(best, time.perf_counter() - t0)
    keys = rows * first + rows * (rows + 1) // 2
    return 4.0 * hq * d * keys / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "qwen3-0.6b"], choices=["smollm2", *SHAPES])
    ap.add_argument("--cases", nargs="+", default=["0:2048", "0:256", "1792:256", "1024:1024"],
                    help="FIRST:ROWS chunks: ROWS new rows after FIRST cached positions")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels.ops()
    if ops is None or ops.prefill_attention_width() == 0:
        raise SystemExit(f"the chunk kernel is not built here: {cpu_kernels.unavailable() or 'a portable build'}")
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':<12} {'first':>6} {'rows':>6} {'GFLOP/s':>9} {'of GEMM rate':>13}")
    for name in args.shapes:
        sh = shape(name)
        hq, hk, d = sh.heads, sh.kv_heads, sh.head_dim
        gemm = gemm_rate(sh, threads=args.threads)
        for case in args.cases:
            first, rows = map(int, case.split(":"))
            r = rate(ops, hq, hk, d, first, rows, args.reps, g)
            print(f"{name:<12} {first:>6} {rows:>6} {r / 1e9:>9.1f} {r / gemm:>12.0%}")
        print(f"{name:<12} {'GEMM rate (large M, best path)':>24}: {gemm / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
