"""What returning logprobs costs: the RL rollout workload (workload A of bench/rollout.py: N chat prompts
submitted at once, n=1, temperature 1, one seed per request) with top-k logprobs against the same run
without, on one `rollbus serve`. Rounds alternate (plain, logprobs, logprobs, plain, ...) so drift on a
shared machine hits both sides alike; seeds make both sides generate the very same tokens.

    python bench/logprobs_cost.py                          # fp32, 64 x 64 tokens, top-5, 3 rounds each
    python bench/logprobs_cost.py --dtype bfloat16 --rounds 5 --json out.json
    python bench/logprobs_cost.py --routed-experts --model /models/tiny-moe   # once MoE capture exists

Then the same comparison without HTTP, processes or scheduling, and robust to other work on the machine:
one ModelRunner in this process decodes two groups of the same prompts, one plain and one with top-k
logprobs, alternating step by step, so any disturbance hits both; reported as the median of the
per-step compute times (what the worker adds per step).

Reports, per side, the best round (least disturbed by other work on a shared machine) and the median
of: useful tokens/s; the CPU seconds all engine processes spent per 1000 tokens (from /proc); the
worker's compute time per step (from /metrics). Then the costs in percent, from the best rounds; the
bar is <= 10 %. Last, the sampler alone in this process with and without top-k (what the worker adds
per step, free of HTTP and scheduling).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import make_prompts, scheduler_counters, table  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.serve_process import start_server  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _one(h: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, seed: int,
               extra: dict) -> int:
    r = await h.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 1.0, "seed": seed, **extra})
    r.raise_for_status()
    body = r.json()
    if "logprobs" in extra:  # make sure the work was really done
        assert len(body["choices"][0]["logprobs"]["top_logprobs"]) == body["usage"]["completion_tokens"]
    return body["usage"]["completion_tokens"]


async def _round(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=512)) as h:
        t0 = time.perf_counter()
        toks = await asyncio.gather(*[_one(h, model, p, max_tokens, i, extra) for i, p in enumerate(prompts)])
        return sum(toks), time.perf_counter() - t0


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def measure(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict, pids: list[int]) -> dict:
    before, cpu0 = scheduler_counters(url), cpu_seconds(pids)
    toks, dt = asyncio.run(_round(url, model, prompts, max_tokens, extra))
    after, cpu1 = scheduler_counters(url), cpu_seconds(pids)
    steps = after["steps"] - before["steps"]
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt, "steps": steps,
            "cpu_s_per_1k": 1e3 * (cpu1 - cpu0) / toks,
            "compute_ms": 1e3 * (after["compute"] - before["compute"]) / max(steps, 1),
            "step_ms": 1e3 * (after["wall"] - before["wall"]) / max(steps, 1)}


def sampler_ms(rows: int, vocab: int, k: int, reps: int = 20) -> float:
    """Best-of time of workers.sampler.sample on [rows, vocab] fp32 logits, temperature 1, seeded rows."""
    import torch

    from engine.sampling_params import SamplingParams
    from workers.sampler import RowState, sample

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    best = float("inf")
    for rep in range(reps):
        states = [RowState(SamplingParams(seed=rep * rows + i, logprobs=k if k else None), [0], [1], [], None)
                  for i in range(rows)]
        t0 = time.perf_counter()
        sample(logits, states, torch.Generator().manual_seed(rep))
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def engine_only(folder: Path, dtype: str, prompts: list[list[int]], steps: int, k: int) -> dict:
    """Median per-step compute of a 64-sequence decode with and without top-k logprobs, steps interleaved."""
    import numpy as np
    import torch

    from bus.messages import NewSeq, StepPlan
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from workers.kv_cache import KVCache
    from workers.loader import load_model
    from workers.model_runner import ModelRunner

    torch.set_grad_enabled(False)
    model, _, _ = load_model(EngineConfig(model=str(folder), dtype=dtype), torch.device("cpu"))
    bs = 16
    per_seq = (max(map(len, prompts)) + steps + bs) // bs
    n = len(prompts)
    kv = KVCache(*model.kv_spec, bs, 2 * n * per_seq, next(model.parameters()).dtype, torch.device("cpu"))
    runner = ModelRunner(model, kv, rank=0, block_size=bs, device=torch.device("cpu"))
    groups = {"plain": None, "logprobs": k}
    tables = {g: [list(range((j + gi * n) * per_seq, (j + gi * n + 1) * per_seq)) for j in range(n)]
              for gi, g in enumerate(groups)}
    times: dict[str, list[float]] = {g: [] for g in groups}
    step_id = 0
    for g, lp in groups.items():
        ids = [f"{g}-{j}" for j in range(n)]
        new = [NewSeq(i, p, SamplingParams(seed=j, logprobs=lp, ignore_eos=True).to_wire(), [])
               for j, (i, p) in enumerate(zip(ids, prompts))]
        step_id += 1
        runner.execute(StepPlan(step_id, new, ids, [0] * n, [len(p) for p in prompts], tables[g], [], 0))
    for s in range(steps):
        for g in groups:
            step_id += 1
            ids = [f"{g}-{j}" for j in range(n)]
            res = runner.execute(StepPlan(step_id, [], ids, [len(p) + s for p in prompts], [1] * n, tables[g], [], 0))
            times[g].append(res.step_time_s)
    plain, lp = np.array(times["plain"]), np.array(times["logprobs"])
    return {"plain_ms": 1e3 * float(np.median(plain)), "logprobs_ms": 1e3 * float(np.median(lp)),
            "paired_delta_ms": 1e3 * float(np.median(lp - plain)), "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--top-logprobs", type=int, default=5, help="logprobs=K on every request of the measured side")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--routed-experts", action="store_true",
                   help="also return routed experts on the measured side: starts the server with "
                        "--enable-return-routed-experts (needs an MoE --model and the MoE capture, issue 5 item 5)")
    p.add_argument("--engine-steps", type=int, default=40, help="decode steps per group of the in-process part")
    p.add_argument("--skip-http", action="store_true", help="only the in-process ModelRunner comparison")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args()

    folder = resolve_model(args.model, progress=True)
    prompts = make_prompts(Tokenizer.from_dir(folder), args.num_prompts)[: args.num_prompts]
    server_args = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", "256"]
    if args.model:
        server_args.insert(0, args.model)
    if args.routed_experts:
        server_args.append("--enable-return-routed-experts")
    say(f"in-process ModelRunner: {args.num_prompts} sequences x {args.engine_steps} decode steps per side ...")
    eng = engine_only(folder, args.dtype, prompts, args.engine_steps, args.top_logprobs)
    eng_line = (f"in-process ModelRunner, {args.num_prompts} decodes per step, median of {args.engine_steps} "
                f"interleaved steps: {eng['plain_ms']:.1f} ms plain, {eng['logprobs_ms']:.1f} ms with "
                f"top-{args.top_logprobs} (paired +{eng['paired_delta_ms']:.2f} ms per step, "
                f"{100 * eng['paired_delta_ms'] / eng['plain_ms']:+.1f} %)")
    if args.skip_http:
        print(eng_line)
        return
    work = Path(tempfile.mkdtemp(prefix="rollbus-lpbench-"))
    say(f"starting rollbus serve {' '.join(server_args)} ...")
    server = start_server(work, *server_args)
    lp_extra = {"logprobs": args.top_logprobs}
    sides = {"plain": {}, f"top-{args.top_logprobs} logprobs": lp_extra}
    names = list(sides)
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        pids = [server.proc.pid, *server.child_pids().values()]
        measure(server.url, model, prompts[:8], 8, {}, pids)  # warm-up
        order = [names[(i // 2 + i) % 2] for i in range(2 * args.rounds)]  # plain, lp, lp, plain, plain, lp, ...
        for i, name in enumerate(order):
            say(f"round {i + 1}/{len(order)}: {name} ...")
            results[name].append(measure(server.url, model, prompts, args.max_tokens, sides[name], pids))
    finally:
        server.stop()
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    say("sampler alone ...")
    micro = {"plain_ms": sampler_ms(args.num_prompts, vocab, 0), "topk_ms": sampler_ms(args.num_prompts, vocab,
                                                                                       args.top_logprobs)}

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base, lp = names
    def best(name: str, key: str) -> float:  # the round least disturbed by other work on the machine
        return max(r[key] for r in results[name]) if key == "tok_s" else min(r[key] for r in results[name])

    rows = [["side", "tokens", "tok/s best", "tok/s median", "tok/s (each round)", "CPU s/1k tok best",
             "compute ms/step best"]]
    for n in names:
        rows.append([n, str(results[n][0]["tokens"]), f"{best(n, 'tok_s'):.1f}", f"{med(n, 'tok_s'):.1f}",
                     " ".join(f"{r['tok_s']:.0f}" for r in results[n]), f"{best(n, 'cpu_s_per_1k'):.2f}",
                     f"{best(n, 'compute_ms'):.1f}"])
    cost = {"throughput_pct": 100 * (1 - best(lp, "tok_s") / best(base, "tok_s")),
            "throughput_median_pct": 100 * (1 - med(lp, "tok_s") / med(base, "tok_s")),
            "cpu_per_token_pct": 100 * (best(lp, "cpu_s_per_1k") / best(base, "cpu_s_per_1k") - 1),
            "compute_per_step_pct": 100 * (best(lp, "compute_ms") / best(base, "compute_ms") - 1),
            "sampler_ms_added": micro["topk_ms"] - micro["plain_ms"]}
    print(f"\n{args.dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens, {args.rounds} rounds per side\n"
          + table(rows))
    print(f"\ncost of {lp} (bar <= 10 %): throughput {cost['throughput_pct']:+.1f} % (best rounds; medians "
          f"{cost['throughput_median_pct']:+.1f} %), CPU per token {cost['cpu_per_token_pct']:+.1f} %, worker "
          f"compute per step {cost['compute_per_step_pct']:+.1f} %")
    print(f"sampler alone, {args.num_prompts} rows x {vocab}: {micro['plain_ms']:.2f} ms plain, "
          f"{micro['topk_ms']:.2f} ms with top-{args.top_logprobs} (+{cost['sampler_ms_added']:.2f} ms per step)")
    print(eng_line)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cost": cost, "sampler": micro,
                                               "engine_only": eng}, indent=2))


if __name__ == "__main__":
    main()
