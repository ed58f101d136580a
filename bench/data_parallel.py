"""Data parallelism on CPU: `rollbus serve -dp 2` (one thread per engine) against `-dp 1` with one thread, in
the same run, on the RL rollout workload (64 prompts submitted at once, exactly 64 new tokens each
(`ignore_eos`, as bench/rollout.py's fixed-length workload), temperature 1.0, seeded, SmolLM2-135M), after a
warm-up request on every engine. Every process gets OMP_NUM_THREADS=1, so -dp 2 uses two cores and -dp 1 one: the
ratio says how well two engines share out the work (bar: >= 1.7x on an idle 2-core machine).

    python bench/data_parallel.py                 # 2 rounds, dp1 and dp2 alternating
    python bench/data_parallel.py --rounds 3 --prompts 64 --max-tokens 64 --json out.json
    python bench/data_parallel.py --rounds 1 --cpu   # and each process's CPU seconds and the steps' times
    python bench/data_parallel.py --async-scheduling # both layouts with rollbus serve --async-scheduling

Seeded sampling does not depend on batch-mates, so both layouts generate the same tokens; throughput is
completion tokens over the wall time of the whole batch. `--eos` lets sequences stop at EOS instead (the two
engines then finish at different times, and the ratio measures that too). The load average is printed with
the result (`uptime`): on a machine busy with other work the ratio is not the bar's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import bus_cost, make_prompts, rollout, say, scheduler_counters  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

ROLES = ("serve", "gateway", "scheduler", "worker", "coordinator")


def process_tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of `root` and every process below it, from /proc: {pid: (role, s)}."""
    stats, parent = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
        pid = int(d.name)
        parent[pid] = int(fields[1])
        role = next((a for a in argv if a in ROLES), argv[0][-20:])
        stats[pid] = (role, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree[pid] = stats[pid]
        todo += [c for c, pp in parent.items() if pp == pid]
    return tree


def run_layout(dp: int, prompts: list[list[int]], max_tokens: int, fixed: bool = True,
               cpu: bool = False, flags: tuple[str, ...] = ()) -> tuple[int, float]:
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with tempfile.TemporaryDirectory(prefix=f"rollbus-dp{dp}-") as work:
        server = start_server(Path(work), "-dp", str(dp), "--max-model-len", "2048", "--max-num-seqs", "256", *flags)
        try:
            if not cpu:
                return asyncio.run(rollout(server.url, model, prompts, 1, max_tokens, fixed=fixed, engines=dp))
            asyncio.run(rollout(server.url, model, prompts[:dp], 1, 4, fixed=fixed, engines=dp))  # warm-up
            before, client, steps = process_tree_cpu(server.proc.pid), os.times(), scheduler_counters(server.url)
            out = asyncio.run(rollout(server.url, model, prompts, 1, max_tokens, fixed=fixed, engines=dp, warm=False))
            after, client_after = process_tree_cpu(server.proc.pid), os.times()
            bus = bus_cost(steps, scheduler_counters(server.url), out[1], dp)
            say(f"  -dp {dp}: {bus['steps']:.0f} steps (all engines), per step: {bus['step_ms']:.1f} ms in the "
                f"scheduler, {bus['compute_ms']:.1f} ms of worker compute, {bus['between_ms']:.1f} ms between steps")
            say(f"  -dp {dp}: CPU seconds during the batch ({out[1]:.2f} s of wall time): client (this process) "
                f"{client_after.user + client_after.system - client.user - client.system:.2f}")
            for pid, (role, t) in sorted(after.items(), key=lambda kv: kv[1][0]):
                used = t - before.get(pid, (role, 0.0))[1]
                say(f"    {role:12s} pid {pid:<8d} {used:7.2f} s ({used / out[1]:.0%} of the wall time)")
            return out
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eos", action="store_true", help="stop at EOS (default: exactly --max-tokens each)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true",
                    help="print each process's CPU seconds during every batch (workers, schedulers, gateway, client)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="serve both layouts with --async-scheduling (plan step N+1 while step N computes)")
    args = ap.parse_args()
    flags = ("--async-scheduling",) if args.async_scheduling else ()
    os.environ["OMP_NUM_THREADS"] = "1"  # every process the servers start: one thread per engine's worker
    tok = Tokenizer.from_dir(resolve_model(None, progress=False))
    prompts = make_prompts(tok, args.prompts)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for dp in (1, 2) if r % 2 == 0 else (2, 1):
            tokens, seconds = run_layout(dp, prompts, args.max_tokens, fixed=not args.eos, cpu=args.cpu, flags=flags)
            rates[dp].append(tokens / seconds)
            say(f"round {r + 1}: -dp {dp}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.0f} tok/s")
    load = os.getloadavg()
    dp1, dp2 = statistics.median(rates[1]), statistics.median(rates[2])
    result = {"dp1_tok_s": round(dp1, 1), "dp2_tok_s": round(dp2, 1), "ratio": round(dp2 / dp1, 3),
              "rounds": args.rounds, "prompts": args.prompts, "fixed_length": not args.eos,
              "max_tokens": args.max_tokens, "async_scheduling": args.async_scheduling,
              "loadavg": [round(x, 2) for x in load], "cpus": os.cpu_count()}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
