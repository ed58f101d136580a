"""One sliding-window attention layer over the paged cache, the CPU kernels against the torch path they replaced
(`ascend_ops.attention.paged_attention(..., window)`, fp32, same inputs, interleaved): --seqs decode rows at
--context tokens, and one prefill of --prompt tokens (in one chunk). Heads: SmolLM2's (9 / 3 of 64), Gemma 3's
(4 / 1 of 256) and Mistral-7B's (32 / 8 of 128); windows 512 and 4,096 (Mistral's own).

  python bench/window_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ascend_ops import attention
from ascend_ops.attention import AttentionMetadata, PrefillChunk

HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "mistral-7b": (32, 8, 128)}
BS = 16


def decode_case(hq: int, hk: int, d: int, seqs: int, context: int, g: torch.Generator):
    nblk = (context + BS - 1) // BS
    kc, vc = (torch.randn(seqs * nblk, BS, hk, d, generator=g) for _ in range(2))
    tables = torch.randperm(seqs * nblk, generator=g).view(seqs, nblk)
    slots = tables[:, -1] * BS + (context - 1) % BS
    meta = AttentionMetadata(slots, num_decodes=seqs, decode_block_tables=tables,
                             decode_ctx_lens=torch.full((seqs,), context), decode_max_ctx=context)
    q, k, v = (torch.randn(seqs, h, d, generator=g) for h in (hq, hk, hk))
    return q, k, v, kc, vc, meta


def prefill_case(hq: int, hk: int, d: int, prompt: int, g: torch.Generator):
    nblk = (prompt + BS - 1) // BS
    kc, vc = (torch.randn(nblk, BS, hk, d, generator=g) for _ in range(2))
    table = torch.randperm(nblk, generator=g)
    pos = torch.arange(prompt)
    meta = AttentionMetadata(table[pos // BS] * BS + pos % BS, prefills=[PrefillChunk(0, prompt, prompt, table)])
    q, k, v = (torch.randn(prompt, h, d, generator=g) for h in (hq, hk, hk))
    return q, k, v, kc, vc, meta


def timed(case, window: int, which: str, reps: int) -> float:
    q, k, v, kc, vc, meta = case
    attention.select(which)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        attention.paged_attention(q, k, v, kc, vc, meta, q.shape[2] ** -0.5, window)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--windows", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=5, help="calls of each, interleaved, after one warm-up")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print("| heads (q / kv x dim) | window | work | torch path ms | kernel ms | speed-up |\n|---|---|---|---|---|---|")
    for name, (hq, hk, d) in HEADS.items():
        cases = {f"{args.seqs} decodes at {args.context}": decode_case(hq, hk, d, args.seqs, args.context, g),
                 f"a {args.prompt}-token prefill": prefill_case(hq, hk, d, args.prompt, g)}
        for window in args.windows:
            for work, case in cases.items():
                for which in ("torch", "kernel"):
                    timed(case, window, which, 1)  # warm-up
                ms = {"torch": [], "kernel": []}
                for _ in range(args.reps):
                    for which in ("torch", "kernel"):
                        ms[which].append(timed(case, window, which, 1))
                t, kk = statistics.median(ms["torch"]), statistics.median(ms["kernel"])
                print(f"| {name} ({hq} / {hk} x {d}) | {window} | {work} | {t:.1f} | {kk:.1f} | {t / kk:.1f}x |",
                      flush=True)
    attention._cpu_choice.clear()


if __name__ == "__main__":
    main()
