"""A/B rollout comparison: this tree against another commit, both served at once, rounds alternating.

Workload A of bench/rollout.py (N chat prompts at once, exactly T new tokens each with ignore_eos,
temperature 1) over HTTP against two live `rollbus serve` processes, one from this checkout and one from
a git worktree of --base, so both see the same machine state; the order alternates each round. Reports
the median tokens/s per side and the ratio (new / base). Use it to check that a change is "no slower than
before" without trusting absolute numbers on a shared machine.

    python bench/rollout_ab.py --base HEAD~1
    python bench/rollout_ab.py --base e70adb4 --num-prompts 64 --max-tokens 64 --rounds 3 --json ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model_store import resolve_model  # noqa: E402
from tests.serve_process import free_port  # noqa: E402


def start(tree: Path, work: Path, dtype: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--dtype", dtype, "--max-model-len",
                             "2048", "--max-num-seqs", "256", "--port", str(port), "--bus-dir", str(work / "bus")],
                            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not become healthy:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)  # polling a condition with a deadline


async def workload_a(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(p: str) -> int:
            r = await client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                "temperature": 1.0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git commit (or ref) to compare this tree against")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="write the per-round numbers here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rollbus-ab-"))
    base_tree = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base_tree), args.base], check=True)
    resolve_model(None, progress=True)  # the default model, prepared once for both servers
    prompts = [f"Write a short story about the number {i}." for i in range(args.num_prompts)]
    servers = {}
    try:
        for side, tree in (("base", base_tree), ("new", ROOT)):
            servers[side] = start(tree, tmp / f"run-{side}", args.dtype)  # not tmp/base: the worktree
        for side, (proc, url, log_path) in servers.items():
            wait_ready(proc, url, log_path)
            print(f"{side} ready: {url}", flush=True)
        model = httpx.get(servers["new"][1] + "/v1/models").json()["data"][0]["id"]
        asyncio.run(workload_a(servers["base"][1], model, prompts[:4], 4))  # warm-up both
        asyncio.run(workload_a(servers["new"][1], model, prompts[:4], 4))
        rates: dict[str, list[float]] = {"base": [], "new": []}
        for rnd in range(args.rounds):
            for side in (("base", "new") if rnd % 2 == 0 else ("new", "base")):
                toks, dt = asyncio.run(workload_a(servers[side][1], model, prompts, args.max_tokens))
                rates[side].append(toks / dt)
                print(f"round {rnd} {side:4s}: {toks} tokens in {dt:6.1f} s = {toks / dt:7.1f} tok/s", flush=True)
        b, n = statistics.median(rates["base"]), statistics.median(rates["new"])
        print(f"\n| workload A ({args.num_prompts} x {args.max_tokens}, {args.dtype}) | base {args.base} | this tree "
              f"| new / base |\n|---|---|---|---|\n| median tok/s of {args.rounds} | {b:.1f} | {n:.1f} | {n / b:.2f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"base": args.base, "rates": rates}, indent=1))
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
        for proc, _, _ in servers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
