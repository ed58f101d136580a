"""What returning logprobs (and routed experts) costs: the RL rollout workload (workload A of
bench/rollout.py: N chat prompts submitted at once, n=1, temperature 1, one seed per request) with top-k
logprobs against the same run without. Rounds rotate over the sides (plain, logprobs, logprobs, plain,
...) so drift on a shared machine hits every side alike; seeds make every side generate the very same
tokens.

    python bench/logprobs_cost.py                          # fp32, 64 x 64 tokens, top-5, 3 rounds each
    python bench/logprobs_cost.py --dtype bfloat16 --rounds 5 --json out.json
    python bench/logprobs_cost.py --routed-experts --model ~/.cache/rollbus/test-models/smollm2-moe-v1 \
        --runner-steps 30                                  # + the worker alone, in this process

    python bench/logprobs_cost.py --sampling-mask          # what --return-sampling-mask costs

--sampling-mask: --return-sampling-mask is server-wide, so two servers run side by side, both with
--enable-scale-out (the mask is returned on /inference/v1/generate only), both sides asking generate for the
same top-k/top-p sampling (--mask-top-k 50 --mask-top-p 0.95, vLLM's sampling-mask example): "top-k/top-p"
on the server without the flag, "top-k/top-p + sampling mask" on the one with it (its responses carry one
row of ids per token, checked). The bar compares the two.

--routed-experts (an MoE --model): --enable-return-routed-experts is server-wide, so two servers run side
by side (only one is measured at a time): the plain and logprobs sides on one started without the flag,
a "top-k logprobs + routed experts" side on one started with it. The bar compares that side with plain.
The upcycled SmolLM2 MoE folder is made by the tests (fixture smollm2_moe_dir) or by
`python -c "from tests.tiny_models import upcycled_smollm2_moe as u; from engine.model_store import
resolve_model as r; print(u(r(None)))"`.

Reports, per side, the best round (least disturbed by other work on a shared machine) and the median
of: useful tokens/s; the CPU seconds all engine processes spent per 1000 tokens (from /proc); the
worker's compute time per step (from /metrics). Then the costs in percent against plain, from the best
rounds; the bar is <= 10 %. Last, the sampler alone in this process with and without top-k (what the
worker adds per step, free of HTTP and scheduling).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_time import cpu_seconds  # noqa: E402
from bench.rollout import make_prompts, scheduler_counters  # noqa: E402
from bench.rollout_report import table  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.serve_process import start_server  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _one(h: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, seed: int,
               extra: dict) -> int:
    body = {k: v for k, v in extra.items() if not k.startswith("_")}
    if extra.get("_generate"):  # the tokens route (the only one that returns the sampling mask)
        r = await h.post("/inference/v1/generate", json={"model": model, "token_ids": prompt, "sampling_params": {
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, **body}})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        mask = choice["sampling_mask"]
        assert (mask is not None and len(mask) == len(choice["token_ids"])) == bool(extra.get("_mask"))
        return len(choice["token_ids"])
    r = await h.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 1.0, "seed": seed, **body})
    r.raise_for_status()
    body = r.json()
    if "logprobs" in extra:  # make sure the work was really done
        assert len(body["choices"][0]["logprobs"]["top_logprobs"]) == body["usage"]["completion_tokens"]
    if extra.get("_routed"):  # the server returns them; check the size (no decoding on the client's CPU)
        assert body["choices"][0]["routed_experts"] is not None
    else:
        assert body["choices"][0]["routed_experts"] is None
    return body["usage"]["completion_tokens"]


async def _round(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=512)) as h:
        t0 = time.perf_counter()
        toks = await asyncio.gather(*[_one(h, model, p, max_tokens, i, extra) for i, p in enumerate(prompts)])
        return sum(toks), time.perf_counter() - t0


def measure(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict, pids: list[int]) -> dict:
    before, cpu0 = scheduler_counters(url), cpu_seconds(pids)
    toks, dt = asyncio.run(_round(url, model, prompts, max_tokens, extra))
    after, cpu1 = scheduler_counters(url), cpu_seconds(pids)
    steps = after["steps"] - before["steps"]
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt, "steps": steps,
            "cpu_s_per_1k": 1e3 * (cpu1 - cpu0) / toks,
            "compute_ms": 1e3 * (after["compute"] - before["compute"]) / max(steps, 1),
            "step_ms": 1e3 * (after["wall"] - before["wall"]) / max(steps, 1)}


def runner_steps(folder: Path, dtype: str, prompts: list[list[int]], steps: int, k: int,
                 truncated: dict | None = None) -> dict:
    """The worker's side alone, robust to other work on the machine: ModelRunners in this process (one
    model; one runner without routed-experts capture, one with) decode the same prompts as three groups,
    plain / top-k logprobs / top-k logprobs + routed experts, alternating step by step so any disturbance
    hits all three. Median per-step compute (step_time_s, which includes the capture's host copy) and the
    median paired difference against plain. With `truncated` (top_k/top_p): two groups sampling with
    them instead, "plain" on a runner without --return-sampling-mask and "sampling mask" on one with it."""
    import numpy as np
    import torch

    from bus.messages import NewSeq, StepPlan
    from bus.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from workers.kv_cache import KVCache
    from workers.loader import load_model
    from workers.model_runner import ModelRunner

    torch.set_grad_enabled(False)
    cpu = torch.device("cpu")
    model, _, _ = load_model(EngineConfig.from_flags(model=str(folder), dtype=dtype), cpu)
    bs, n = 16, len(prompts)
    per_seq = (max(map(len, prompts)) + steps + bs) // bs
    groups = {"plain": (False, None), "logprobs": (False, k), "logprobs + routed": (True, k)}
    if truncated:
        groups = {"plain": (False, None), "sampling mask": (True, None)}
    runners = {}
    for capture in (False, True):
        blocks = n * per_seq * sum(1 for c, _ in groups.values() if c == capture)
        kv = KVCache(*model.kv_spec, bs, blocks, next(model.parameters()).dtype, cpu)
        extra = {"return_sampling_mask": capture} if truncated else {"return_routed_experts": capture}
        runners[capture] = ModelRunner(model, kv, rank=0, block_size=bs, device=cpu, **extra)
    tables, used = {}, {False: 0, True: 0}
    for g, (capture, _) in groups.items():
        tables[g] = [list(range((used[capture] + j) * per_seq, (used[capture] + j + 1) * per_seq)) for j in range(n)]
        used[capture] += n
    times: dict[str, list[float]] = {g: [] for g in groups}
    step_id = 0
    for g, (capture, lp) in groups.items():
        ids = [f"{g}-{j}" for j in range(n)]
        new = [NewSeq(i, p, SamplingParams(seed=j, logprobs=lp, ignore_eos=True, **(truncated or {})), [])
               for j, (i, p) in enumerate(zip(ids, prompts))]
        step_id += 1
        runners[capture].execute(StepPlan(step_id, new, ids, [0] * n, [len(p) for p in prompts], tables[g], [], 0))
    for s in range(steps):
        for g, (capture, _) in groups.items():
            step_id += 1
            ids = [f"{g}-{j}" for j in range(n)]
            res = runners[capture].execute(StepPlan(step_id, [], ids, [len(p) + s for p in prompts], [1] * n,
                                                    tables[g], [], 0))
            assert ((res.sampling_mask_counts if truncated else res.routed_experts) is not None) == capture
            times[g].append(res.step_time_s)
    t = {g: np.array(v) for g, v in times.items()}
    return {"steps": steps, "sequences": n,
            **{f"{g} ms": 1e3 * float(np.median(v)) for g, v in t.items()},
            **{f"{g} paired +ms": 1e3 * float(np.median(v - t["plain"])) for g, v in t.items() if g != "plain"}}


def sampler_ms(rows: int, vocab: int, k: int, reps: int = 20, mask: bool = False, **sp) -> float:
    """Best-of time of workers.sampler.sample on [rows, vocab] fp32 logits, temperature 1, seeded rows (`sp`:
    more sampling parameters; `mask`: with each row's sampling mask)."""
    import torch

    from bus.sampling_params import SamplingParams
    from workers.sampler import RowState, sample

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    best = float("inf")
    for rep in range(reps):
        states = [RowState(SamplingParams(seed=rep * rows + i, logprobs=k if k else None, **sp), [0], [1], [], None)
                  for i in range(rows)]
        t0 = time.perf_counter()
        sample(logits, states, torch.Generator().manual_seed(rep), sampling_mask=mask)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--top-logprobs", type=int, default=5, help="logprobs=K on every request of the measured side")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--routed-experts", action="store_true",
                   help="add a side returning top-k logprobs and routed experts, on a second server started with "
                        "--enable-return-routed-experts (needs an MoE --model)")
    p.add_argument("--runner-steps", type=int, default=0,
                   help="with --routed-experts or --sampling-mask: also compare the worker alone in this process "
                        "(ModelRunner, N interleaved decode steps per group; see runner_steps)")
    p.add_argument("--sampling-mask", action="store_true",
                   help="measure --return-sampling-mask instead: top-k/top-p sampling on /inference/v1/generate, "
                        "on a server without the flag and on one with it")
    p.add_argument("--mask-top-k", type=int, default=50, help="with --sampling-mask: top_k of every request")
    p.add_argument("--mask-top-p", type=float, default=0.95, help="with --sampling-mask: top_p of every request")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args()

    folder = resolve_model(args.model, progress=True)
    prompts = make_prompts(Tokenizer.from_dir(folder), args.num_prompts)[: args.num_prompts]
    server_args = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", "256"]
    if args.model:
        server_args.insert(0, args.model)
    flags = {"off": server_args}
    if args.routed_experts:
        flags["on"] = [*server_args, "--enable-return-routed-experts"]
    lp_extra = {"logprobs": args.top_logprobs}
    sides = {"plain": ("off", {}), f"top-{args.top_logprobs} logprobs": ("off", lp_extra)}
    truncated = {"top_k": args.mask_top_k, "top_p": args.mask_top_p}
    if args.sampling_mask:
        flags = {"off": [*server_args, "--enable-scale-out"],
                 "on": [*server_args, "--enable-scale-out", "--return-sampling-mask"]}
        sides = {"top-k/top-p": ("off", {**truncated, "_generate": True}),
                 "top-k/top-p + sampling mask": ("on", {**truncated, "_generate": True, "_mask": True})}
    if args.routed_experts:
        sides[f"top-{args.top_logprobs} logprobs + routed experts"] = ("on", {**lp_extra, "_routed": True})
    names = list(sides)
    results: dict[str, list[dict]] = {n: [] for n in names}
    servers = {}
    try:
        for key, argv in flags.items():
            say(f"starting rollbus serve {' '.join(argv)} ...")
            servers[key] = start_server(Path(tempfile.mkdtemp(prefix="rollbus-lpbench-")), *argv)
        model = httpx.get(servers["off"].url + "/v1/models").json()["data"][0]["id"]
        pids = {k: [srv.proc.pid, *srv.child_pids().values()] for k, srv in servers.items()}
        for name in names:  # warm-up, every side
            key, extra = sides[name]
            measure(servers[key].url, model, prompts[:8], 8, extra, pids[key])
        k = len(names)
        # plain, lp, lp, plain, plain, lp, ... for two sides; a rotation (ABC, BCA, CAB, ...) for three
        order = ([names[(i // 2 + i) % 2] for i in range(2 * args.rounds)] if k == 2 else
                 [names[(r + j) % k] for r in range(args.rounds) for j in range(k)])
        for i, name in enumerate(order):
            key, extra = sides[name]
            say(f"round {i + 1}/{len(order)}: {name} ...")
            r = measure(servers[key].url, model, prompts, args.max_tokens, extra, pids[key])
            results[name].append(r)
            say(f"  {r['tok_s']:.1f} tok/s, {r['cpu_s_per_1k']:.2f} CPU s/1k tok, {r['compute_ms']:.1f} ms/step")
    finally:
        for srv in servers.values():
            srv.stop()
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    say("sampler alone ...")
    micro = {"plain_ms": sampler_ms(args.num_prompts, vocab, 0), "topk_ms": sampler_ms(args.num_prompts, vocab,
                                                                                       args.top_logprobs)}
    if args.sampling_mask:
        micro["truncated_ms"] = sampler_ms(args.num_prompts, vocab, 0, **truncated)
        micro["truncated_mask_ms"] = sampler_ms(args.num_prompts, vocab, 0, mask=True, **truncated)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base = names[0]

    def best(name: str, key: str) -> float:  # the round least disturbed by other work on the machine
        return max(r[key] for r in results[name]) if key == "tok_s" else min(r[key] for r in results[name])

    rows = [["side", "tokens", "tok/s best", "tok/s median", "tok/s (each round)", "CPU s/1k tok best",
             "compute ms/step best"]]
    for n in names:
        rows.append([n, str(results[n][0]["tokens"]), f"{best(n, 'tok_s'):.1f}", f"{med(n, 'tok_s'):.1f}",
                     " ".join(f"{r['tok_s']:.0f}" for r in results[n]), f"{best(n, 'cpu_s_per_1k'):.2f}",
                     f"{best(n, 'compute_ms'):.1f}"])
    cost = {lp: {"throughput_pct": 100 * (1 - best(lp, "tok_s") / best(base, "tok_s")),
                 "throughput_median_pct": 100 * (1 - med(lp, "tok_s") / med(base, "tok_s")),
                 "cpu_per_token_pct": 100 * (best(lp, "cpu_s_per_1k") / best(base, "cpu_s_per_1k") - 1),
                 "compute_per_step_pct": 100 * (best(lp, "compute_ms") / best(base, "compute_ms") - 1)}
            for lp in names[1:]}
    cost["sampler_ms_added"] = micro["topk_ms"] - micro["plain_ms"]
    print(f"\n{folder.name}, {args.dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens, {args.rounds} "
          f"rounds per side\n" + table(rows))
    for lp in names[1:]:
        c = cost[lp]
        print(f"\ncost of {lp} (bar <= 10 %): throughput {c['throughput_pct']:+.1f} % (best rounds; medians "
              f"{c['throughput_median_pct']:+.1f} %), CPU per token {c['cpu_per_token_pct']:+.1f} %, worker "
              f"compute per step {c['compute_per_step_pct']:+.1f} %")
    print(f"sampler alone, {args.num_prompts} rows x {vocab}: {micro['plain_ms']:.2f} ms plain, "
          f"{micro['topk_ms']:.2f} ms with top-{args.top_logprobs} (+{cost['sampler_ms_added']:.2f} ms per step)")
    if args.sampling_mask:
        print(f"sampler alone with top_k {args.mask_top_k}, top_p {args.mask_top_p}: {micro['truncated_ms']:.2f} ms, "
              f"{micro['truncated_mask_ms']:.2f} ms with the sampling mask "
              f"(+{micro['truncated_mask_ms'] - micro['truncated_ms']:.2f} ms per step)")
    runner = None
    if args.sampling_mask and args.runner_steps:
        say(f"ModelRunner alone: {args.num_prompts} sequences x {args.runner_steps} decode steps per group ...")
        runner = runner_steps(folder, args.dtype, prompts, args.runner_steps, 0, truncated)
        plain, added = runner["plain ms"], runner["sampling mask paired +ms"]
        print(f"ModelRunner alone, {args.num_prompts} decodes per step with top_k {args.mask_top_k}, top_p "
              f"{args.mask_top_p}, median of {args.runner_steps} interleaved steps: {plain:.1f} ms without the "
              f"mask; with it {runner['sampling mask ms']:.1f} ms (paired {added:+.2f} ms, "
              f"{100 * added / plain:+.1f} %)")
    if args.routed_experts and args.runner_steps:
        say(f"ModelRunner alone: {args.num_prompts} sequences x {args.runner_steps} decode steps per group ...")
        runner = runner_steps(folder, args.dtype, prompts, args.runner_steps, args.top_logprobs)
        plain = runner["plain ms"]
        print(f"ModelRunner alone, {args.num_prompts} decodes per step, median of {args.runner_steps} interleaved "
              f"steps: {plain:.1f} ms plain; " + "; ".join(
                  f"{g} {runner[g + ' ms']:.1f} ms (paired {runner[g + ' paired +ms']:+.2f} ms, "
                  f"{100 * runner[g + ' paired +ms'] / plain:+.1f} %)" for g in ("logprobs", "logprobs + routed")))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cost": cost, "sampler": micro,
                                               "runner_steps": runner}, indent=2))


if __name__ == "__main__":
    main()
