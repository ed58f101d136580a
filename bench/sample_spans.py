"""A wide decode step with the sampler in spans of rows (workers.sampler.sample_in_spans, the default) against
the same step with the LM head and the sampler over all rows at once, in one process, alternating ABBA.

With all rows at once, a 1,024-row step's logits and log-softmax are 200 MB each for SmolLM2: above glibc's
largest mmap threshold (32 MiB), so they are mapped, faulted in and unmapped every step, and on huge pages
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, what `rollbus serve` gives CPU workers) each fault may stall on
compaction. Run it as a worker runs:

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 OMP_NUM_THREADS=1 python bench/sample_spans.py --seqs 1024 --ctx 60
    python bench/sample_spans.py --seqs 256 --rounds 4      # 4 KiB pages
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.step_profile as step_profile  # noqa: E402
import workers.sampler as sampler  # noqa: E402
from bus.messages import NewSeq, StepPlan  # noqa: E402
from bus.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=1024)
    p.add_argument("--ctx", type=int, default=60, help="prompt tokens per sequence (ragged: ctx-7 .. ctx)")
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (4 timed steps each)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.seqs
    runner, per_seq = step_profile.build(argparse.Namespace(seqs=n, ctx=args.ctx, steps=4 * args.rounds + 4,
                                                            warmup=0, dtype="float32"), None)
    params = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True)
    ids = [f"s{i}" for i in range(n)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
    torch.manual_seed(0)
    prompts = [torch.randint(0, 49152, (args.ctx - i % 8,)).tolist() for i in range(n)]
    step = 0
    for a in range(0, n, 64):
        step += 1
        new = [NewSeq(s, q, params, [0]) for s, q in zip(ids[a:a + 64], prompts[a:a + 64])]
        runner.execute(StepPlan(step, new, ids[a:a + 64], [0] * len(new), [len(q) for q in prompts[a:a + 64]],
                                tables[a:a + 64], [], 0))
    spans = sampler.span_rows

    def one(kind: str) -> float:
        nonlocal step
        sampler.span_rows = spans if kind == "spans" else (lambda vocab: n)
        step += 1
        plan = StepPlan(step, [], ids, [len(runner.seqs[s].tokens) - 1 for s in ids], [1] * n, tables, [], 0)
        t0 = time.perf_counter()
        runner.execute(plan)
        return time.perf_counter() - t0

    one("spans"), one("whole")  # warm-up
    got: dict[str, list[float]] = {"spans": [], "whole": []}
    for r in range(args.rounds):
        for kind in ("spans", "whole", "whole", "spans") if r % 2 == 0 else ("whole", "spans", "spans", "whole"):
            got[kind].append(one(kind))
    print(f"SmolLM2-135M fp32, {n} sequences at ~{args.ctx} tokens, {args.threads} thread(s), "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}, spans of {spans(49152)} rows")
    print("| sampling | median step ms | tok/s | steps (ms) |\n|---|---|---|---|")
    for kind, v in got.items():
        med = statistics.median(v)
        print(f"| {kind} | {med * 1e3:.0f} | {n / med:.0f} | {' '.join(f'{x * 1e3:.0f}' for x in v)} |")
    print(f"whole / spans: {statistics.median(got['whole']) / statistics.median(got['spans']):.2f}x")


if __name__ == "__main__":
    main()
