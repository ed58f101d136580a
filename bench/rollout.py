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
    python bench/rollout.py --emulate-no-native-bf16 avx2  # as on a CPU without bf16 (bench/no_native_bf16.py)
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import no_native_bf16  # noqa: E402
from bench.cpu_time import tree_cpu_seconds  # noqa: E402
from bench.fma_peak import fma_peak  # noqa: E402
from bench.gemm_ceiling import Shape, ceiling_tok_s, gemm_rate, prefill_ceiling_tok_s  # noqa: E402
from bench.model_shapes import SHAPES, shape_folder  # noqa: E402
from bench.rollout_report import plot, report  # noqa: E402
from bench.rollout_workloads import AGENTIC, LONG, WIDE, agentic, distinct_prompts, long_prompts  # noqa: E402
from bench.vllm_peer import CONFIGS, VLLM_PY, vllm_server  # noqa: E402
from engine.config import KV_CACHE_DTYPES  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.serve_process import start_server  # noqa: E402
from workers.kv_cache import KVCache, cache_dtype  # noqa: E402

TOPICS = ["the ocean", "a robot", "mathematics", "autumn", "a city at night", "friendship", "volcanoes",
          "the moon", "coffee", "a library", "rain", "chess", "bicycles", "music", "a forest", "time"]
TASKS = ["Write a short poem about {}.", "Explain {} to a child.", "List facts about {}.", "Tell a story about {}."]


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


def warm_up(url: str, model: str, prompt: list[int], *, engines: int = 1, seeds: bool = True) -> None:
    """One short request per data-parallel engine (each named by its X-data-parallel-rank)."""
    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as h:
            await _warm_up(h, model, prompt, seeds, True, engines)

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
               engines: int, seeds: bool = True) -> dict:
    """A fixed-length workload run `repeats` times on warm engines, each from an empty prefix cache: the run of
    median throughput, with every run's tok/s ("runs") and their seconds together ("seconds_all"). A host's
    speed drifts from one run to the next; one sample is not enough to judge a bar by."""
    outs = []
    for _ in range(repeats):
        reset_prefix_cache(url)  # every run prefills all of its prompts, as a peer's single run does
        outs.append(_run(name, url, model, prompts, n, max_tokens, True, seeds=seeds, engines=engines, warm=False))
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
    if args.agentic:  # the last turn's conversation
        seqs = max(seqs, AGENTIC[0])
        tokens = max(tokens, max(len(p) for p in prompts[: AGENTIC[0]]) + AGENTIC[1] * (AGENTIC[2] + AGENTIC[3]))
    if args.long:  # the second burst beside the decoding streams
        seqs, tokens = max(seqs, LONG[0] + LONG[3]), max(tokens, LONG[1] + LONG[2])
    per_token = KVCache.bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, 1,
                                        cache_dtype(args.kv_cache_dtype, getattr(torch, dtype)))
    need = -(-seqs // engines) * tokens * per_token * 1.1
    return max(1, -(-int(need) // (1 << 30)))


def engine_workloads(who: str, url: str, prompts: list[list[int]], args, engines: int = 1,
                     rollbus: bool = True, pid: int | None = None) -> dict:
    """Every workload asked for, against one server at `url`; rollbus: also its scheduler counters (the bus
    cost per step), and per-request seeds (vLLM's CPU build kills its engine on one). pid: the server's, whose
    process tree's CPU seconds during A are recorded (A's "cpu_s"), with the load average after A."""
    bus = seeds = rollbus
    out: dict = {}
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    say(f"[{who}] A: {args.num_prompts} prompts x exactly {args.max_tokens} tokens ...")
    warm_up(url, model, prompts[0], engines=engines, seeds=seeds)  # before the counters: its steps are not A's
    before = scheduler_counters(url) if bus else None
    cpu0 = tree_cpu_seconds(pid) if pid else None
    out["A"] = _cold_runs(args.repeats, f"{who} A", url, model, prompts[: args.num_prompts], 1, args.max_tokens,
                          engines, seeds)
    if pid:
        out["A"]["cpu_s"] = tree_cpu_seconds(pid) - cpu0  # every run of A together, as "seconds_all"
    out["A"]["loadavg"] = os.getloadavg()[0]
    if bus:
        out["bus"] = bus_cost(before, scheduler_counters(url), out["A"]["seconds_all"], engines)
    if "B" not in args.skip:
        say(f"[{who}] B: 16 prompts x n=8 ...")
        reset_prefix_cache(url)  # from an empty cache, as A: its prompts are A's first 16
        out["B"] = _run(f"{who} B", url, model, prompts[:16], 8, args.max_tokens, False, seeds, engines=engines)
    if args.wide:
        say(f"[{who}] W: {WIDE[0]} prompts x n={WIDE[1]} x exactly {WIDE[2]} tokens ...")
        before = scheduler_counters(url) if bus else None
        out["W"] = _cold_runs(args.repeats, f"{who} W", url, model, prompts[: WIDE[0]], WIDE[1], WIDE[2], engines,
                              seeds)
        if bus:
            out["bus_W"] = bus_cost(before, scheduler_counters(url), out["W"]["seconds_all"], engines)
    for streams in () if "C" in args.skip else (1, 32):
        say(f"[{who}] C: {streams} concurrent streams ...")
        out[f"C{streams}"] = asyncio.run(latency(url, model, prompts, streams, args.max_tokens))
    if args.agentic:
        say(f"[{who}] M: {AGENTIC[0]} conversations x {AGENTIC[1]} turns ...")
        reset_prefix_cache(url)
        out["M"] = agentic(url, model, prompts[: AGENTIC[0]], AGENTIC[1], AGENTIC[2], AGENTIC[3], args.vocab)
    if args.long:
        say(f"[{who}] L: {LONG[0]} prompts of {LONG[1]} tokens, then again beside {LONG[3]} decoding streams ...")
        reset_prefix_cache(url)
        out["L"] = long_prompts(url, model, distinct_prompts(LONG[0], LONG[1], args.vocab), LONG[2], prompts[0],
                                LONG[3], LONG[4])
    return out


def server_flags(args) -> list[str]:
    """The flags both servers get: the model's length limit and batch width, dummy weights for a --shape."""
    flags = ["--max-model-len", str(max_model_len(args)), "--max-num-seqs", str(args.max_num_seqs)]
    return flags + (["--load-format", "dummy"] if args.shape_name != "smollm2" else [])


def max_model_len(args) -> int:
    return 4096 if args.long else 2048


def bench_rollbus(dtype: str, folder: Path, prompts: list[list[int]], args, dp: int = 1) -> dict:
    """The workloads against `rollbus serve` with `dp` data-parallel engines on this host (`-dp`: each worker
    gets its share of the cores, as rollbus serve gives it)."""
    say(f"[rollbus {dtype}] starting the server (-dp {dp}) ...")
    work = Path(tempfile.mkdtemp(prefix="rollbus-bench-"))
    t0 = time.perf_counter()
    layout = ("-dp", str(dp)) if dp > 1 else ()
    gib = kv_gib(args.shape, dtype, prompts, args, dp)
    server = start_server(work, str(folder), "--dtype", dtype, *server_flags(args),
                          "--kv-cache-memory-bytes", f"{gib}G", "--kv-cache-dtype", args.kv_cache_dtype, *layout,
                          *(("--async-scheduling",) if args.async_scheduling else ()),
                          *(("--no-in-batch-prefix-sharing",) if args.no_in_batch_prefix_sharing else ()),
                          *(() if args.prefill_tokens_beside_decodes is None else
                            ("--prefill-tokens-beside-decodes", str(args.prefill_tokens_beside_decodes))),
                          env={"VLLM_SERVER_DEV_MODE": "1"}, timeout_s=900)  # dev mode: POST /reset_prefix_cache
    out: dict = {"ready_s": time.perf_counter() - t0, "dp": dp, "kv_gib_per_engine": gib}
    try:
        workers = httpx.get(server.url + "/server_info", timeout=60).json()["workers"].values()
        out["cpu_linear"] = sorted({w["cpu_linear"] for w in workers})
        want = args.emulate_no_native_bf16 and no_native_bf16.expected_cpu_linear(args.emulate_no_native_bf16, dtype)
        if want and out["cpu_linear"] != [want]:
            raise RuntimeError(f"rollbus {dtype}: /server_info's cpu_linear {out['cpu_linear']}, the emulation's "
                               f"is {want}")
        out.update(engine_workloads(f"rollbus {dtype}", server.url, prompts, args, dp, pid=server.proc.pid))
    finally:
        server.stop()
    return out


# --- vLLM's CPU build ---------------------------------------------------------------------------

def bench_vllm(dtype: str, folder: Path, prompts: list[list[int]], args, config: str) -> dict:
    """vLLM's OpenAI server (the vllm-cpu venv, docs/benchmarks.md) in `config` (bench/vllm_peer.py) on the
    same folder and workloads, without per-request seeds."""
    with vllm_server(Path(args.vllm_python), folder, dtype, config, kv_gib(args.shape, dtype, prompts, args),
                     max_model_len(args), args.max_num_seqs, tuple(server_flags(args)[4:]), say) as url:
        return engine_workloads(f"vllm {config} {dtype}", url, prompts, args, rollbus=False)


# --- HF transformers -----------------------------------------------------------------------------

def bench_hf(dtype: str, folder: Path, tok: Tokenizer, prompts: list[list[int]], n: int, max_tokens: int,
             library_defaults: bool = False, fixed: bool = False) -> dict:
    """HF generate on one left-padded batch. By default with the same sampling as rollbus (temperature
    1, no top-k/top-p); library_defaults leaves HF's own defaults in place (top_k=50). fixed: exactly
    max_tokens per row (min_new_tokens), every token useful."""
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):  # a --shape: random weights
        from transformers import AutoConfig

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype)).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pad = tok.eos_token_ids[0]
    batch = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    torch.manual_seed(0)
    with torch.no_grad():  # warm-up, as the servers get one
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, pad_token_id=pad)
    t0, cpu0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        filters = {} if library_defaults else {"top_p": 1.0, "top_k": 0}
        if fixed:
            filters["min_new_tokens"] = max_tokens
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             max_new_tokens=max_tokens, pad_token_id=pad, **filters)
    dt, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    if fixed:
        return {"tokens": out.shape[0] * max_tokens, "seconds": dt, "tok_s": out.shape[0] * max_tokens / dt,
                "cpu_s": cpu_s, "loadavg": os.getloadavg()[0]}
    useful = 0
    eos = set(tok.eos_token_ids)
    for row in out[:, width:].tolist():
        k = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        useful += k
    return {"tokens": useful, "seconds": dt, "tok_s": useful / dt}


# --- the command line (the report: bench/rollout_report.py) -------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="Do not run HF generate.")
    p.add_argument("--vllm", action="store_true", help="Also run vLLM's CPU build (its venv, see docs/benchmarks.md).")
    p.add_argument("--vllm-python", default=str(VLLM_PY), help="Python of the vLLM venv.")
    p.add_argument("--vllm-configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="How vLLM runs (bench/vllm_peer.py): 'tuned' as its CPU guide advises, 'default' as it "
                        "starts with nothing set. Ratios are against the first given (default: both, tuned first).")
    p.add_argument("--shape", default="smollm2", choices=["smollm2", *SHAPES],
                   help="smollm2: the default model's real weights; a Qwen3 shape: its config and tokenizer with "
                        "--load-format dummy weights in both servers (HF: random init).")
    p.add_argument("--agentic", action="store_true",
                   help=f"Add workload M: {AGENTIC[0]} conversations x {AGENTIC[1]} turns, each turn the whole "
                        f"conversation + {AGENTIC[3]} tool-result tokens, {AGENTIC[2]} new tokens.")
    p.add_argument("--long", action="store_true",
                   help=f"Add workload L: {LONG[0]} prompts of {LONG[1]} tokens x {LONG[2]} new tokens, alone and "
                        f"beside {LONG[3]} decoding streams (their ITL during the prefills).")
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
    p.add_argument("--no-in-batch-prefix-sharing", action="store_true",
                   help="rollbus's --no-in-batch-prefix-sharing: every request computes its own prompt, as vLLM "
                        "(on by default: requests sent together that share a prefix compute it once).")
    p.add_argument("--prefill-tokens-beside-decodes", type=int, default=None, metavar="N",
                   help="rollbus's --prefill-tokens-beside-decodes (0: no limit, as vLLM; default: rollbus's own, 256 "
                        "on CPU): what workload L's long prompts may take of a step while anything decodes.")
    p.add_argument("--repeats", type=int, default=1, metavar="K",
                   help="Run rollbus's A and W K times on the same server and report the median (every run's "
                        "tok/s is printed and saved).")
    p.add_argument("--emulate-no-native-bf16", choices=list(no_native_bf16.EMULATIONS),
                   help="Run everything as a CPU without native bf16 would, on this host (bench/no_native_bf16.py): "
                        "avx2 as AMD Zen 2/3, avx512 as Intel Cascade Lake. Not with --vllm.")
    p.add_argument("--skip", nargs="+", choices=["B", "C"],
                   help="Workloads not to run (B, C); A always runs.")
    p.add_argument("--json", help="Write all numbers to this file.")
    p.add_argument("--plot", help="Save a bar chart (needs matplotlib).")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1")
    args.skip = args.skip or []
    emulated = args.emulate_no_native_bf16
    if emulated and args.vllm:
        p.error("--emulate-no-native-bf16 with --vllm: vLLM's CPU build picks its kernels from the CPU itself")
    no_native_bf16.reexec_if_needed(emulated)  # torch, oneDNN and MKL read their caps at start-up
    emulation = emulated and no_native_bf16.check(emulated)
    if emulation:
        say(f"[machine] {emulation}")

    if args.vllm_configs[0] != "tuned" and args.vllm and "tuned" in args.vllm_configs:
        args.vllm_configs.sort(key=lambda c: c != "tuned")  # the headline ratio is against the tuned peer
    args.shape_name = args.shape
    folder = (resolve_model(None, progress=True) if args.shape == "smollm2"
              else shape_folder(args.shape, Path(tempfile.mkdtemp(prefix="rollbus-shape-"))))
    tok = Tokenizer.from_dir(folder)
    prompts = make_prompts(tok, max(WIDE[0] if args.wide else 64, args.num_prompts))
    shape = args.shape = Shape.from_folder(folder)
    args.vocab = range(1000, min(shape.vocab, 30000))  # token ids for tool results and long prompts
    results: dict = {}
    say("[machine] fp32 FMA peak (register-only loop, every core) ...")
    peak = fma_peak(avx512=emulated != "avx2")["flops"]
    for dtype in args.dtypes:
        say(f"[machine {dtype}] large-GEMM rate ...")
        before = gemm_rate(shape, dtype)
        layouts = {dp: bench_rollbus(dtype, folder, prompts, args, dp) for dp in args.rollbus_dp}
        say(f"[machine {dtype}] large-GEMM rate again ...")
        after = gemm_rate(shape, dtype)
        # the higher of the two: a host that slowed while one was measured must not lower the ceiling
        rate = max(before, after)
        r = layouts[args.rollbus_dp[0]]
        r["layouts"] = {f"dp{dp}": x for dp, x in layouts.items() if x is not r}
        r["gemm_gflops"] = rate / 1e9
        r["fma_peak_gflops"] = peak / 1e9
        r["fma_ceiling_A"] = ceiling_tok_s(shape, [len(p) for p in prompts[: args.num_prompts]], args.max_tokens, 1,
                                           peak)
        r["gemm_gflops_before_after"] = [before / 1e9, after / 1e9]
        r["ceiling_A"] = ceiling_tok_s(shape, [len(p) for p in prompts[: args.num_prompts]], args.max_tokens, 1, rate)
        if args.wide:
            r["ceiling_W"] = ceiling_tok_s(shape, [len(p) for p in prompts[: WIDE[0]]], WIDE[2], WIDE[1], rate)
        if args.long:
            r["ceiling_L_prefill"] = prefill_ceiling_tok_s(shape, [LONG[1]] * LONG[0], rate)
        if args.vllm:
            r["vllm_all"] = {c: bench_vllm(dtype, folder, prompts, args, c) for c in args.vllm_configs}
            r["vllm"] = r["vllm_all"][args.vllm_configs[0]]
        if not args.skip_hf:
            say(f"[hf {dtype}] A: generate on one left-padded batch of {args.num_prompts} ...")
            r["hf_A"] = bench_hf(dtype, folder, tok, prompts[: args.num_prompts], 1, args.max_tokens,
                                 args.hf_library_defaults, fixed=True)
            if "B" not in args.skip:
                say(f"[hf {dtype}] B: 16 prompts x 8 ...")
                r["hf_B"] = bench_hf(dtype, folder, tok, prompts[:16], 8, args.max_tokens, args.hf_library_defaults)
        results[dtype] = r

    report(results, args, peak, emulation)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
