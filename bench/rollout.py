"""RL rollout benchmark: rollbus (all processes, over HTTP) against HF transformers `generate` and,
with --vllm, vLLM's CPU build over HTTP, on the same weights, in the same run, and against the machine
itself: the GEMM ceiling (bench/gemm_ceiling.py), measured in the same run before and after rollbus's
workloads (the higher rate counts: a host that slowed during one measurement must not lower the ceiling).

Workloads (per dtype):
  A  64 chat prompts submitted at once, exactly 64 new tokens each (ignore_eos), temperature 1.0
  B  16 prompts x n=8, 64 new tokens, temperature 1.0
  W  (--wide) 256 prompts x n=4, 128 new tokens, ignore_eos: the widest batch RL forms
  C  streaming latency: time to first token and inter-token latency at 1 and 32 concurrent streams
  D  the bus hop: scheduler's wall time per step minus the worker's compute time per step

A and W are fixed-length (every engine computes the same tokens); in B "useful" tokens stop at each
sequence's first eos (inclusive), for every engine. Engines run one after the other, never sharing the
cores. vLLM's CPU build gets no per-request seed (it kills its engine on one: "CPU Generator does not
use offset").

    python bench/rollout.py                      # fp32 and bf16, prints tables
    python bench/rollout.py --dtypes float32 --vllm --json out.json --plot out.png
    python bench/rollout.py --dtypes float32 --wide --skip-hf
    python bench/rollout.py --dtypes float32 --vllm --rollbus-dp 1 2   # rollbus as one engine and as -dp 2
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemm_ceiling import Shape, ceiling_tok_s, gemm_rate  # noqa: E402
from engine.config import KV_CACHE_DTYPES  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.serve_process import start_server  # noqa: E402
from workers.kv_cache import KVCache, cache_dtype  # noqa: E402

TOPICS = ["the ocean", "a robot", "mathematics", "autumn", "a city at night", "friendship", "volcanoes",
          "the moon", "coffee", "a library", "rain", "chess", "bicycles", "music", "a forest", "time"]
TASKS = ["Write a short poem about {}.", "Explain {} to a child.", "List facts about {}.", "Tell a story about {}."]


WIDE = (256, 4, 128)  # the wide workload: prompts, n, new tokens


def make_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = TASKS[i % len(TASKS)].format(TOPICS[i % len(TOPICS)])
        out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
    return out


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- rollbus -------------------------------------------------------------------------------------

async def _complete(h: httpx.AsyncClient, model: str, prompt: list[int], n: int, max_tokens: int,
                    seed: int | None, fixed: bool, headers: dict | None = None) -> int:
    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0}
    if seed is not None:
        body["seed"] = seed
    if fixed:
        body["ignore_eos"] = True
    r = await h.post("/v1/completions", json=body, headers=headers)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def _warm_up(h: httpx.AsyncClient, model: str, prompt: list[int], seeds: bool, fixed: bool, engines: int) -> None:
    for rank in range(engines):
        await _complete(h, model, prompt, 1, 4, 0 if seeds else None, fixed,
                        headers={"X-data-parallel-rank": str(rank)} if engines > 1 else None)


def warm_up(url: str, model: str, prompt: list[int], *, engines: int = 1) -> None:
    """One short request per data-parallel engine (each named by its X-data-parallel-rank)."""
    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as h:
            await _warm_up(h, model, prompt, True, True, engines)

    asyncio.run(run())


async def rollout(url: str, model: str, prompts: list[list[int]], n: int, max_tokens: int, *, fixed: bool = False,
                  seeds: bool = True, engines: int = 1, warm: bool = True) -> tuple[int, float]:
    """Completion tokens and wall seconds of every prompt submitted at once, after one warm-up request per
    data-parallel engine (`engines`; `warm=False`: the caller warmed them up)."""
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1024)) as h:
        if warm:
            await _warm_up(h, model, prompts[0], seeds, fixed, engines)
        t0 = time.perf_counter()
        toks = await asyncio.gather(*[_complete(h, model, p, n, max_tokens, i if seeds else None, fixed)
                                      for i, p in enumerate(prompts)])
        return sum(toks), time.perf_counter() - t0


def _run(name: str, url: str, model: str, prompts: list[list[int]], n: int, max_tokens: int, fixed: bool,
         seeds: bool = True, engines: int = 1, warm: bool = True) -> dict:
    toks, dt = asyncio.run(rollout(url, model, prompts, n, max_tokens, fixed=fixed, seeds=seeds, engines=engines,
                                   warm=warm))
    if fixed and toks != len(prompts) * n * max_tokens:
        raise RuntimeError(f"{name}: {toks} tokens, expected exactly {len(prompts) * n * max_tokens}")
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt}


def reset_prefix_cache(url: str) -> None:
    """Forget every cached prefix (vLLM's dev endpoint), so the next run prefills its prompts: repeated runs
    of one workload would otherwise find them cached by the run before, which no single run of a peer does."""
    r = httpx.post(url + "/reset_prefix_cache", timeout=60)
    if r.status_code != 200 or not r.json().get("success"):
        raise RuntimeError(f"POST /reset_prefix_cache: {r.status_code} {r.text}")


def _cold_runs(repeats: int, name: str, url: str, model: str, prompts: list[list[int]], n: int, max_tokens: int,
               engines: int) -> dict:
    """A fixed-length workload run `repeats` times on warm engines, each from an empty prefix cache: the run of
    median throughput, with every run's tok/s ("runs") and their seconds together ("seconds_all"). A host's
    speed drifts from one run to the next; one sample is not enough to judge a bar by."""
    outs = []
    for _ in range(repeats):
        reset_prefix_cache(url)  # every run prefills all of its prompts, as a peer's single run does
        outs.append(_run(name, url, model, prompts, n, max_tokens, True, engines=engines, warm=False))
    mid = sorted(outs, key=lambda o: o["tok_s"])[(len(outs) - 1) // 2]
    return {**mid, "runs": [o["tok_s"] for o in outs], "seconds_all": sum(o["seconds"] for o in outs)}


async def _stream(h: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with h.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])]


async def latency(url: str, model: str, prompts: list[list[int]], streams: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as h:
        res = await asyncio.gather(*[_stream(h, model, prompts[i % len(prompts)], max_tokens)
                                     for i in range(streams)])
    ttfts = [r[0] for r in res]
    itls = [x for r in res for x in r[1]]
    return {"ttft_ms_p50": 1e3 * statistics.median(ttfts), "ttft_ms_max": 1e3 * max(ttfts),
            "itl_ms_p50": 1e3 * statistics.median(itls), "itl_ms_p99": 1e3 * _pct(itls, 0.99)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def scheduler_counters(url: str) -> dict[str, float]:
    want = {"rollbus_step_latency_seconds_count": "steps", "rollbus_step_latency_seconds_sum": "wall",
            "rollbus_step_compute_total": "compute"}
    out = dict.fromkeys(want.values(), 0.0)
    for line in httpx.get(url + "/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want:  # summed over engines (-dp): per-step averages stay per step
            out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


def bus_cost(before: dict[str, float], after: dict[str, float], seconds: float, engines: int) -> dict[str, float]:
    """Per step of one workload (counters summed over engines): the scheduler's wall time of a step, the
    worker's compute in it, the bus hop (their difference) and the time between steps (the workload's wall
    time per engine-step less the step itself: planning, the gateway, waiting for requests)."""
    steps = after["steps"] - before["steps"]
    step_ms = 1e3 * (after["wall"] - before["wall"]) / steps
    compute_ms = 1e3 * (after["compute"] - before["compute"]) / steps
    return {"steps": steps, "step_ms": step_ms, "compute_ms": compute_ms, "hop_ms": step_ms - compute_ms,
            "between_ms": 1e3 * seconds * engines / steps - step_ms}


def kv_gib(shape: Shape, dtype: str, prompts: list[list[int]], args, engines: int = 1) -> int:
    """Whole GiB of KV cache per engine that hold every sequence of the widest workload run (W with --wide,
    else A's and B's) at once, with 10% to spare: the same for rollbus and vLLM (VLLM_CPU_KVCACHE_SPACE)."""
    seqs, tokens = max(args.num_prompts, 16 * 8), max(len(p) for p in prompts) + args.max_tokens
    if args.wide:
        seqs, tokens = max(seqs, WIDE[0] * WIDE[1]), max(tokens, max(len(p) for p in prompts[: WIDE[0]]) + WIDE[2])
    per_token = KVCache.bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, 1,
                                        cache_dtype(args.kv_cache_dtype, getattr(torch, dtype)))
    need = -(-seqs // engines) * tokens * per_token * 1.1
    return max(1, -(-int(need) // (1 << 30)))


def bench_rollbus(dtype: str, prompts: list[list[int]], args, dp: int = 1) -> dict:
    """The workloads against `rollbus serve` with `dp` data-parallel engines on this host (`-dp`: each worker
    gets its share of the cores, as rollbus serve gives it)."""
    say(f"[rollbus {dtype}] starting the server (-dp {dp}) ...")
    work = Path(tempfile.mkdtemp(prefix="rollbus-bench-"))
    t0 = time.perf_counter()
    layout = ("-dp", str(dp)) if dp > 1 else ()
    gib = kv_gib(args.shape, dtype, prompts, args, dp)
    server = start_server(work, "--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
                          "--kv-cache-memory-bytes", f"{gib}G", "--kv-cache-dtype", args.kv_cache_dtype, *layout,
                          *(("--async-scheduling",) if args.async_scheduling else ()),
                          env={"VLLM_SERVER_DEV_MODE": "1"})  # for POST /reset_prefix_cache between runs
    out: dict = {"ready_s": time.perf_counter() - t0, "dp": dp, "kv_gib_per_engine": gib}
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        say(f"[rollbus {dtype}] A: {args.num_prompts} prompts x exactly {args.max_tokens} tokens ...")
        warm_up(server.url, model, prompts[0], engines=dp)  # before the counters: its steps are not A's
        before = scheduler_counters(server.url)
        out["A"] = _cold_runs(args.repeats, "rollbus A", server.url, model, prompts[: args.num_prompts], 1,
                              args.max_tokens, dp)
        out["bus"] = bus_cost(before, scheduler_counters(server.url), out["A"]["seconds_all"], dp)
        say(f"[rollbus {dtype}] B: 16 prompts x n=8 ...")
        out["B"] = _run("rollbus B", server.url, model, prompts[:16], 8, args.max_tokens, False, engines=dp)
        if args.wide:
            say(f"[rollbus {dtype}] W: {WIDE[0]} prompts x n={WIDE[1]} x exactly {WIDE[2]} tokens ...")
            before = scheduler_counters(server.url)  # the engines are warm (A's warm-up)
            out["W"] = _cold_runs(args.repeats, "rollbus W", server.url, model, prompts[: WIDE[0]], WIDE[1], WIDE[2],
                                  dp)
            out["bus_W"] = bus_cost(before, scheduler_counters(server.url), out["W"]["seconds_all"], dp)
        for streams in (1, 32):
            say(f"[rollbus {dtype}] C: {streams} concurrent streams ...")
            out[f"C{streams}"] = asyncio.run(latency(server.url, model, prompts, streams, args.max_tokens))
    finally:
        server.stop()
    return out


# --- vLLM's CPU build ---------------------------------------------------------------------------

VLLM_PY = Path.home() / ".cache/vllm-cpu/bin/python"


def bench_vllm(dtype: str, folder: Path, prompts: list[list[int]], args) -> dict:
    """vLLM's OpenAI server (the vllm-cpu venv, docs/benchmarks.md) on the same folder and workloads,
    without per-request seeds."""
    import os
    import signal
    import subprocess

    from tests.serve_process import free_port

    py = Path(args.vllm_python)
    if not py.exists():
        raise SystemExit(f"--vllm: {py} does not exist (install vLLM's CPU build: docs/benchmarks.md)")
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib(args.shape, dtype, prompts, args))}
    say(f"[vllm {dtype}] starting its server (about 3 minutes; log {log}) ...")
    with open(log, "w") as f:
        proc = subprocess.Popen([str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                 "--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
                                 "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after 900 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        say(f"[vllm {dtype}] A: {args.num_prompts} prompts x exactly {args.max_tokens} tokens ...")
        out = {"A": _run("vllm A", url, model, prompts[: args.num_prompts], 1, args.max_tokens, True, seeds=False)}
        say(f"[vllm {dtype}] B: 16 prompts x n=8 ...")
        out["B"] = _run("vllm B", url, model, prompts[:16], 8, args.max_tokens, False, seeds=False)
        if args.wide:
            say(f"[vllm {dtype}] W ...")
            out["W"] = _run("vllm W", url, model, prompts[: WIDE[0]], WIDE[1], WIDE[2], True, seeds=False)
        out["C32"] = asyncio.run(latency(url, model, prompts, 32, args.max_tokens))
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


# --- HF transformers -----------------------------------------------------------------------------

def bench_hf(dtype: str, folder: Path, tok: Tokenizer, prompts: list[list[int]], n: int, max_tokens: int,
             library_defaults: bool = False, fixed: bool = False) -> dict:
    """HF generate on one left-padded batch. By default with the same sampling as rollbus (temperature
    1, no top-k/top-p); library_defaults leaves HF's own defaults in place (top_k=50). fixed: exactly
    max_tokens per row (min_new_tokens), every token useful."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pad = tok.eos_token_ids[0]
    batch = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    torch.manual_seed(0)
    with torch.no_grad():  # warm-up, as the servers get one
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, pad_token_id=pad)
    t0 = time.perf_counter()
    with torch.no_grad():
        filters = {} if library_defaults else {"top_p": 1.0, "top_k": 0}
        if fixed:
            filters["min_new_tokens"] = max_tokens
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             max_new_tokens=max_tokens, pad_token_id=pad, **filters)
    dt = time.perf_counter() - t0
    if fixed:
        return {"tokens": out.shape[0] * max_tokens, "seconds": dt, "tok_s": out.shape[0] * max_tokens / dt}
    useful = 0
    eos = set(tok.eos_token_ids)
    for row in out[:, width:].tolist():
        k = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        useful += k
    return {"tokens": useful, "seconds": dt, "tok_s": useful / dt}


# --- report --------------------------------------------------------------------------------------

def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="Do not run HF generate.")
    p.add_argument("--vllm", action="store_true", help="Also run vLLM's CPU build (its venv, see docs/benchmarks.md).")
    p.add_argument("--vllm-python", default=str(VLLM_PY), help="Python of the vLLM venv.")
    p.add_argument("--wide", action="store_true",
                   help=f"Add workload W: {WIDE[0]} prompts x n={WIDE[1]} x {WIDE[2]} tokens (long on a CPU).")
    p.add_argument("--max-num-seqs", type=int, default=1024, help="Both servers' --max-num-seqs.")
    p.add_argument("--hf-library-defaults", action="store_true",
                   help="Run HF generate with its own sampling defaults (top_k=50) instead of rollbus's.")
    p.add_argument("--rollbus-dp", type=int, nargs="+", default=[1], metavar="M",
                   help="rollbus layouts to run, each as `rollbus serve -dp M` on this host (one row each; "
                        "-dp 2 on 2 cores: two engines of one thread). Default: 1.")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="rollbus's --kv-cache-dtype (vLLM's CPU build runs with the model's dtype).")
    p.add_argument("--async-scheduling", action="store_true",
                   help="rollbus's --async-scheduling (plan step N+1 while step N computes; off by default on CPU).")
    p.add_argument("--repeats", type=int, default=1, metavar="K",
                   help="Run rollbus's A and W K times on the same server and report the median (every run's "
                        "tok/s is printed and saved).")
    p.add_argument("--json", help="Write all numbers to this file.")
    p.add_argument("--plot", help="Save a bar chart (needs matplotlib).")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1")

    folder = resolve_model(None, progress=True)
    tok = Tokenizer.from_dir(folder)
    prompts = make_prompts(tok, max(WIDE[0] if args.wide else 64, args.num_prompts))
    shape = args.shape = Shape.from_config(json.loads((folder / "config.json").read_text()))
    results: dict = {}
    for dtype in args.dtypes:
        say(f"[machine {dtype}] large-GEMM rate ...")
        before = gemm_rate(shape, dtype)
        layouts = {dp: bench_rollbus(dtype, prompts, args, dp) for dp in args.rollbus_dp}
        say(f"[machine {dtype}] large-GEMM rate again ...")
        after = gemm_rate(shape, dtype)
        # the higher of the two: a host that slowed while one was measured must not lower the ceiling
        rate = max(before, after)
        r = layouts[args.rollbus_dp[0]]
        r["layouts"] = {f"dp{dp}": x for dp, x in layouts.items() if x is not r}
        r["gemm_gflops"] = rate / 1e9
        r["gemm_gflops_before_after"] = [before / 1e9, after / 1e9]
        r["ceiling_A"] = ceiling_tok_s(shape, [len(p) for p in prompts[: args.num_prompts]], args.max_tokens, 1, rate)
        if args.wide:
            r["ceiling_W"] = ceiling_tok_s(shape, [len(p) for p in prompts[: WIDE[0]]], WIDE[2], WIDE[1], rate)
        if args.vllm:
            r["vllm"] = bench_vllm(dtype, folder, prompts, args)
        if not args.skip_hf:
            say(f"[hf {dtype}] A: generate on one left-padded batch of {args.num_prompts} ...")
            r["hf_A"] = bench_hf(dtype, folder, tok, prompts[: args.num_prompts], 1, args.max_tokens,
                                 args.hf_library_defaults, fixed=True)
            say(f"[hf {dtype}] B: 16 prompts x 8 ...")
            r["hf_B"] = bench_hf(dtype, folder, tok, prompts[:16], 8, args.max_tokens, args.hf_library_defaults)
        results[dtype] = r

    def cell(x: float | None, fmt: str = "{:.0f}") -> str:
        return fmt.format(x) if x else "-"

    rows = [["dtype", "workload", "rollbus tok/s", "vLLM tok/s", "HF tok/s", "vs vLLM", "vs HF", "GEMM ceiling",
             "of ceiling"]]
    for dtype, r in results.items():
        work = [("A", f"{args.num_prompts}x{args.max_tokens} fixed"), ("B", "16 x n=8")]
        work += [("W", f"{WIDE[0]} x n={WIDE[1]} x {WIDE[2]} fixed")] if "W" in r else []
        for w, name in work:
            for lay in (r, *r["layouts"].values()):
                ours = lay[w]["tok_s"]
                vl = r.get("vllm", {}).get(w, {}).get("tok_s")
                hf = r.get(f"hf_{w}", {}).get("tok_s")
                ceil = r.get(f"ceiling_{w}")
                label = name + (f", rollbus -dp {lay['dp']}" if len(args.rollbus_dp) > 1 or lay["dp"] > 1 else "")
                label += f", KV {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
                label += ", async scheduling" if args.async_scheduling else ""
                rows.append([dtype, label, cell(ours), cell(vl), cell(hf), cell(vl and ours / vl, "{:.2f}x"),
                             cell(hf and ours / hf, "{:.2f}x"), cell(ceil), cell(ceil and ours / ceil, "{:.0%}")])
    print("\nThroughput (useful tokens/s; the GEMM ceiling is the workload's FLOPs at the large-GEMM rate "
          "measured in this run, before and after rollbus's workloads, the higher of the two: "
          + ", ".join(f"{d} {r['gemm_gflops']:.0f} GFLOP/s ({'{:.0f} / {:.0f}'.format(*r['gemm_gflops_before_after'])})"
                      for d, r in results.items()) + ")\n" + table(rows))
    if args.repeats > 1:
        print("\nrollbus's runs (tok/s, in the order run; the table gives the median):")
        for dtype, r in results.items():
            for lay in (r, *r["layouts"].values()):
                for w in ("A", "W"):
                    if w in lay:
                        print(f"  {dtype} -dp {lay['dp']} {w}: " + ", ".join(f"{x:.0f}" for x in lay[w]["runs"]))
    rows = [["dtype", "streams", "TTFT p50 ms", "TTFT max ms", "ITL p50 ms", "ITL p99 ms"]]
    for dtype, r in results.items():
        for lay in (r, *r["layouts"].values()):
            for s in (1, 32):
                c = lay[f"C{s}"]
                who = dtype + (f" -dp {lay['dp']}" if len(args.rollbus_dp) > 1 or lay["dp"] > 1 else "")
                rows.append([who, str(s), f"{c['ttft_ms_p50']:.1f}", f"{c['ttft_ms_max']:.1f}",
                             f"{c['itl_ms_p50']:.1f}", f"{c['itl_ms_p99']:.1f}"])
        if "vllm" in r:
            c = r["vllm"]["C32"]
            rows.append([f"{dtype} vLLM", "32", f"{c['ttft_ms_p50']:.1f}", f"{c['ttft_ms_max']:.1f}",
                         f"{c['itl_ms_p50']:.1f}", f"{c['itl_ms_p99']:.1f}"])
    print("\nStreaming latency over HTTP\n" + table(rows))
    rows = [["dtype", "workload", "steps", "step ms (scheduler)", "compute ms (worker)", "bus hop ms/step",
             "between steps ms"]]
    for dtype, r in results.items():
        for w, key in (("A", "bus"), ("W", "bus_W")):
            if key in r:
                b = r[key]
                rows.append([dtype, w, f"{b['steps']:.0f}", f"{b['step_ms']:.2f}", f"{b['compute_ms']:.2f}",
                             f"{b['hop_ms']:.3f}", f"{b['between_ms']:.2f}"])
    print("\nBus cost per step (workloads A and W; counters summed over engines)\n" + table(rows))
    print("\nServer ready in: " + ", ".join(f"{d} {r['ready_s']:.1f}s" for d, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        _plot(results, args.plot)


def _plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot")
        return
    labels, ours, theirs = [], [], []
    for dtype, r in results.items():
        for w in ("A", "B"):
            labels.append(f"{dtype} {w}")
            ours.append(r[w]["tok_s"])
            theirs.append(r.get(f"hf_{w}", {}).get("tok_s", 0))
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="rollbus")
    ax.bar([i + 0.2 for i in x], theirs, 0.4, label="HF generate")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("useful tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    say(f"plot saved to {path}")


if __name__ == "__main__":
    main()
