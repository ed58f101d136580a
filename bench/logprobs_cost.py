"""What returning logprobs costs: the RL rollout workload (workload A of bench/rollout.py: N chat prompts
submitted at once, n=1, temperature 1, one seed per request) with top-k logprobs against the same run
without, on one `rollbus serve`. Rounds alternate (plain, logprobs, logprobs, plain, ...) so drift on a
shared machine hits both sides alike; seeds make both sides generate the very same tokens.

    python bench/logprobs_cost.py                          # fp32, 64 x 64 tokens, top-5, 3 rounds each
    python bench/logprobs_cost.py --dtype bfloat16 --rounds 5 --json out.json
    python bench/logprobs_cost.py --routed-experts --model /models/tiny-moe   # once MoE capture exists

Reports useful tokens/s (median over rounds), the worker's compute time per step (from /metrics) and
the throughput cost in percent; the bar is <= 10 %.
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


def measure(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict) -> dict:
    before = scheduler_counters(url)
    toks, dt = asyncio.run(_round(url, model, prompts, max_tokens, extra))
    after = scheduler_counters(url)
    steps = after["steps"] - before["steps"]
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt, "steps": steps,
            "compute_ms": 1e3 * (after["compute"] - before["compute"]) / max(steps, 1),
            "step_ms": 1e3 * (after["wall"] - before["wall"]) / max(steps, 1)}


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
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args()

    folder = resolve_model(args.model, progress=True)
    prompts = make_prompts(Tokenizer.from_dir(folder), args.num_prompts)[: args.num_prompts]
    server_args = ["--dtype", args.dtype, "--max-model-len", "2048", "--max-num-seqs", "256"]
    if args.model:
        server_args.insert(0, args.model)
    if args.routed_experts:
        server_args.append("--enable-return-routed-experts")
    work = Path(tempfile.mkdtemp(prefix="rollbus-lpbench-"))
    say(f"starting rollbus serve {' '.join(server_args)} ...")
    server = start_server(work, *server_args)
    lp_extra = {"logprobs": args.top_logprobs}
    sides = {"plain": {}, f"top-{args.top_logprobs} logprobs": lp_extra}
    names = list(sides)
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        measure(server.url, model, prompts[:8], 8, {})  # warm-up
        order = [names[(i // 2 + i) % 2] for i in range(2 * args.rounds)]  # plain, lp, lp, plain, plain, lp, ...
        for i, name in enumerate(order):
            say(f"round {i + 1}/{len(order)}: {name} ...")
            results[name].append(measure(server.url, model, prompts, args.max_tokens, sides[name]))
    finally:
        server.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base, lp = names
    rows = [["side", "tokens", "tok/s (median)", "tok/s (each round)", "compute ms/step", "step ms"]]
    for n in names:
        rows.append([n, str(results[n][0]["tokens"]), f"{med(n, 'tok_s'):.1f}",
                     " ".join(f"{r['tok_s']:.0f}" for r in results[n]), f"{med(n, 'compute_ms'):.2f}",
                     f"{med(n, 'step_ms'):.2f}"])
    cost = 100 * (1 - med(lp, "tok_s") / med(base, "tok_s"))
    compute_cost = 100 * (med(lp, "compute_ms") / med(base, "compute_ms") - 1)
    print(f"\n{args.dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens, {args.rounds} rounds per side\n"
          + table(rows))
    print(f"\nthroughput cost of {lp}: {cost:+.1f} %  (worker compute per step: {compute_cost:+.1f} %; bar <= 10 %)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cost_pct": cost,
                                               "compute_cost_pct": compute_cost}, indent=2))


if __name__ == "__main__":
    main()
