"""Workload L's second half in process, without HTTP: rollbus's Scheduler policy driving the worker's ModelRunner
(SmolLM2-135M fp32, real weights): `--streams` sequences decoding, then `--prompts` prompts of 2,048 tokens
arrive; every step's wall time while they prefill and decode. Compares --prefill-tokens-beside-decodes values on
the same host in one sitting (a loaded host moves absolute times; the ratios hold better):

  python bench/prefill_beside_decodes.py --cap 256 --threads 1
  python bench/prefill_beside_decodes.py --cap 0 --threads 1        # no limit: what vLLM does
  python bench/prefill_beside_decodes.py --cap 256 --streams 0      # the long prompts alone
  python bench/prefill_beside_decodes.py --cap 256 --streams 0 --prompts 16   # workload L's first half: a burst
  python bench/prefill_beside_decodes.py --cap 256 --streams 0 --prompts 16 --beside-streams 0   # cap 256 from 1 decode

Prints the calm decode step (streams only), the steps while the long prompts are in (p50, p99, max), how long
the long prompts took to finish, and their prefill rate (prompt tokens / time to the last one's first token, as
workload L counts it) with their time to first token (p50).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import workers.model_runner as mr
from ascend_ops.platform import tune_host_allocator
from bus.messages import NewSeq, StepPlan
from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.model_store import resolve_model
from engine.request import Sequence
from engine.scheduler import Scheduler
from engine.scheduler.chunk_limits import PREFILL_BESIDE_STREAMS
from workers.kv_cache import KVCache
from workers.models.checkpoint import iter_checkpoint, load_hf_config
from workers.models.registry import build_model

BLOCKS, BS = 1600, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=int, default=256, help="--prefill-tokens-beside-decodes (0: no limit)")
    p.add_argument("--beside-streams", type=int, default=PREFILL_BESIDE_STREAMS,
                   help="decoding streams at which --cap holds as given; beside d fewer, the first long prompt's "
                        "chunk may take cap x this / d (0: --cap whatever decodes, the rule before stop 44)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_host_allocator()
    folder = resolve_model(None)
    model = build_model(load_hf_config(folder), torch.float32, "cpu")
    model.load_weights(iter_checkpoint(folder))
    kv = KVCache.for_model(model, BS, BLOCKS, torch.float32, torch.device("cpu"))
    runner = mr.ModelRunner(model, kv, rank=0, block_size=BS, device=torch.device("cpu"))
    sched = Scheduler(BlockManager(BLOCKS, BS), 256, 2048, 4096, prefill_beside_decodes=args.cap,
                      prefill_beside_streams=args.beside_streams)
    gen = torch.Generator().manual_seed(0)
    step_id = 0

    def add(sid: str, n: int, max_tokens: int) -> None:
        prompt = torch.randint(1000, 30000, (n,), generator=gen).tolist()
        sched.add(Sequence(sid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=[0]))

    firsts: dict[str, float] = {}

    def step() -> float:
        nonlocal step_id
        st = sched.schedule()
        step_id += 1
        new = [NewSeq(q.seq_id, q.prompt_token_ids, q.sampling, q.eos_token_ids) for q in st.new_seqs]
        plan = StepPlan(step_id, new, st.seq_ids, st.num_computed, st.num_new, [q.block_table for q in st.seqs],
                        st.finished_ids, 0)
        t0 = time.perf_counter()
        res = runner.execute(plan)
        dt = time.perf_counter() - t0
        for u in sched.update(st, {i: (int(t), float(lp), None)
                                   for i, t, lp in zip(res.seq_ids, res.token_ids, res.logprobs)}):
            firsts.setdefault(u.seq.seq_id, time.perf_counter())
        return dt

    for i in range(args.streams):
        add(f"s{i}", 20, 1000)
    calm = [step() for _ in range(8)][3:] if args.streams else [float("nan")]
    for j in range(args.prompts):
        add(f"L{j}", 2048, 32)
    during, t0, cpu0 = [], time.perf_counter(), time.process_time()
    while any(q.seq_id.startswith("L") for q in [*sched.running, *sched.waiting]):
        during.append(step())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    d = sorted(during)
    ttft = sorted(firsts[f"L{j}"] - t0 for j in range(args.prompts))
    p50, p99 = statistics.median(d), d[min(len(d) - 1, int(0.99 * len(d)))]
    print(f"cap {args.cap} (as given from {args.beside_streams} decoding), {args.streams} streams, "
          f"{torch.get_num_threads()} threads: calm step "
          f"{statistics.median(calm) * 1e3:.0f} ms; with the long prompts in: {len(d)} steps, p50 {p50 * 1e3:.0f} ms, "
          f"p99 {p99 * 1e3:.0f} ms, max {d[-1] * 1e3:.0f} ms (p99 / p50 {p99 / p50:.1f}); the {args.prompts} long "
          f"prompts done in {wall:.1f} s ({cpu:.1f} s of CPU); prefill {2048 * args.prompts / ttft[-1]:.0f} tok/s, "
          f"TTFT p50 {statistics.median(ttft):.1f} s")


if __name__ == "__main__":
    main()
