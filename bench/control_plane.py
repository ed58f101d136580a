"""Control-plane benchmark (issue: RL control plane): how fast the acknowledged broadcasts are, and
what sleep gives back.

  1. one control broadcast acked by 4 worker processes (real coordinator, real sockets): p50/p99
  2. /pause?mode=abort with 64 running requests, and /resume, on `rollbus serve` (SmolLM2)
  3. sleep level 2: bytes released against weights + KV; RSS over 50 sleep/wake cycles;
     waking from level 1 against one memcpy of the weight bytes in the same run
  4. codec: encode + decode of a 256-output OutputBatch (and a StepPlan/StepResult of 64 sequences)
  5. the scheduler's turnaround at 64 running sequences: its own time between a step's results and the
     next plan, measured inside the real scheduler actor (counters turnaround_total / turnarounds)

    python bench/control_plane.py [--cycles 50] [--turnaround-runs 1] [--only codec,turnaround,broadcast,serve]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus.control_client import ControlClient  # noqa: E402
from bus.endpoints import Endpoints  # noqa: E402
from bus.messages import Health  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from tests.procstats import mapping_rss, rss  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MEMBER = """
import sys, time, zmq
from bus.endpoints import Endpoints
from bus.member import MemberLink
from engine.config import EngineConfig
ep = Endpoints.from_config(EngineConfig.from_flags(bus_dir=sys.argv[1]))
link = MemberLink(zmq.Context(), ep, role="worker", name=sys.argv[2], default=lambda c: None)
poller = zmq.Poller()
for s in link.sockets:
    poller.register(s, zmq.POLLIN)
while True:
    for s, _ in poller.poll(250):
        link.handle(s)
    link.tick(time.monotonic())
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def broadcast_latency(n_workers: int = 4, rounds: int = 500) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="rollbus-cp-")
    cfg = EngineConfig.from_flags(bus_dir=work)
    procs = [subprocess.Popen([sys.executable, "-m", "engine.cli", "coordinator", *cfg.to_argv()])]
    procs += [subprocess.Popen([sys.executable, "-c", MEMBER, work, f"worker-{i}"]) for i in range(n_workers)]
    client = ControlClient(Endpoints.from_config(cfg))
    try:
        deadline = time.monotonic() + 60
        while len(client.request(Health()).results) < n_workers:
            assert time.monotonic() < deadline, "workers never joined"
        lat = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            reply = client.request(Health())
            lat.append(time.perf_counter() - t0)
            assert reply.ok and len(reply.results) == n_workers
        return {"p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * pct(lat, 0.99)}
    finally:
        client.close()
        for p in procs:
            p.terminate()


async def _long_requests(url: str, n: int) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as h:
        return await asyncio.gather(*[h.post("/v1/completions", json={
            "model": MODEL, "prompt": f"Request {i}: tell a long story.", "max_tokens": 1000, "ignore_eos": True})
            for i in range(n)])


def running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def serve_benchmarks(cycles: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="rollbus-cp-serve-"))
    s = start_server(work, "--additional-config", '{"rl_config": {"enabled": true}}', "--enable-sleep-mode",
                     "--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "2048")
    out: dict = {}
    try:
        url, worker = s.url, s.child_pids()["worker-0"]
        h = httpx.Client(timeout=60)  # one connection: a new client per call costs tens of ms itself
        say("pause?mode=abort with 64 running requests ...")
        pauses, resumes = [], []
        for _ in range(3):
            import threading

            th = threading.Thread(target=lambda: asyncio.run(_long_requests(url, 64)))
            th.start()
            while running(url) < 64:
                time.sleep(0.05)
            t0 = time.perf_counter()
            assert h.post(url + "/pause", params={"mode": "abort"}).status_code == 200
            pauses.append(time.perf_counter() - t0)
            th.join(120)
            time.sleep(0.5)  # resume comes after the weight update, when the aborted responses are long gone
            t0 = time.perf_counter()
            assert h.post(url + "/resume").status_code == 200
            resumes.append(time.perf_counter() - t0)
        out["pause_abort_ms"] = 1e3 * statistics.median(pauses)
        out["resume_ms"] = 1e3 * statistics.median(resumes)

        say("sleep level 2 ...")
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=60)
        info = httpx.get(url + "/server_info").json()
        kv_bytes = int(info["engine_config"]["kv_cache_memory_bytes"])
        weight_bytes = 134_515_008 * 4
        start_rss, kv_in_ram = rss(worker), mapping_rss(worker, kv_bytes)
        r = httpx.post(url + "/sleep", params={"level": 2}, timeout=60).json()
        out["level2_released_frac"] = r["released_bytes"] / (kv_bytes + weight_bytes)
        # the KV is faulted in lazily: what it held in RAM is its resident pages, not its size
        out["level2_rss_drop_frac"] = (start_rss - rss(worker)) / (kv_in_ram + weight_bytes)
        httpx.post(url + "/wake_up", timeout=60)
        httpx.post(url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120)

        say(f"{cycles} sleep/wake cycles ...")
        base = rss(worker)
        samples = []
        for i in range(cycles):
            level = 1 + i % 2
            httpx.post(url + "/sleep", params={"level": level}, timeout=60)
            httpx.post(url + "/wake_up", params={"tags": "weights"}, timeout=60)
            if level == 2:
                httpx.post(url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120)
            httpx.post(url + "/wake_up", params={"tags": "kv_cache"}, timeout=60)
            samples.append(rss(worker))
        out["cycles_rss_drift_frac"] = (samples[-1] - base) / base
        out["cycles_rss_max_frac"] = (max(samples) - base) / base

        say("level-1 wake against a memcpy of the weight bytes ...")
        wakes = []
        for _ in range(5):
            httpx.post(url + "/sleep", params={"level": 1}, timeout=60)
            t0 = time.perf_counter()
            h.post(url + "/wake_up")
            wakes.append(time.perf_counter() - t0)
        src = torch.empty(weight_bytes // 4)
        dst = torch.empty_like(src)
        copies = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        out["wake1_ms"] = 1e3 * statistics.median(wakes)
        out["memcpy_weights_ms"] = 1e3 * statistics.median(copies)
    finally:
        s.stop()
    return out


def codec_cost(reps: int = 2000) -> dict[str, float]:
    """Median encode + decode time of the messages on the step path."""
    import numpy as np

    from bus.codec import decode, encode
    from bus.messages import NewSeq, OutputBatch, RequestOutput, StepPlan, StepResult
    from bus.sampling_params import SamplingParams

    stats = {"num_running": 256, "num_waiting": 3, "kv_usage": 0.41, "step_time_s": 0.012, "num_preemptions": 0,
             "prefix_cache_queries": 1000, "prefix_cache_hits": 400, "steps": 1234.0, "step_time_total": 15.2,
             "step_compute_total": 14.1, "prompt_tokens": 4096.0, "generation_tokens": 99999.0}
    plain = OutputBatch([RequestOutput(f"cmpl-{i:032x}-0", [1000 + i], None, None, False, None, None, None, 40, 0, 3)
                         for i in range(256)], stats)
    top5 = OutputBatch([RequestOutput(f"cmpl-{i:032x}-0", [1000 + i], [-0.25], [[(1000 + i + k, -0.25 * k) for k in
                                      range(5)]], False, None, None, None, 40, 0, 3, ranks=[1])
                        for i in range(256)], stats)
    sp = SamplingParams(temperature=1.0, max_tokens=512, seed=3)
    plan = StepPlan(9, [NewSeq("new", list(range(200)), sp, [2])], [f"s{i}" for i in range(64)], [300] * 64,
                    [1] * 64, [list(range(20)) for _ in range(64)], [], 1)
    res = StepResult(9, 0, [f"s{i}" for i in range(64)], np.arange(64), np.zeros(64, np.float32),
                     np.zeros((64, 0), np.int64), np.zeros((64, 0), np.float32), 1, None, 0.01, np.ones(64, np.int64),
                     np.ones(64, np.float32))
    out = {}
    for name, msg in (("batch256", plain), ("batch256_top5", top5), ("plan64", plan), ("result64", res)):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            decode(encode(msg))
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
    return out


def scheduler_turnaround(seqs: int = 64, tokens: int = 64, runs: int = 1) -> dict[str, float]:
    """The real coordinator, scheduler and worker processes (a 2-layer model of SmolLM2's shapes, from
    bench/bus_hop.py), `seqs` requests running together for `tokens` decode steps (`runs` times, on the
    same engine); the scheduler counts its own time from the last StepResult of a step to the next
    StepPlan."""
    import uuid

    import zmq

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bus_hop import make_model, prompts, start_engine

    from bus.codec import decode
    from bus.messages import AddRequest, OutputBatch
    from bus.sampling_params import SamplingParams
    from bus.sockets import make_socket, send

    work = Path(tempfile.mkdtemp(prefix="rollbus-turn-"))
    make_model(work / "model")
    cfg, procs = start_engine(work / "model", work / "bus")
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=Endpoints.from_config(cfg).requests, identity="bench")

        def run(n: int, max_tokens: int) -> tuple[dict, list[float]]:
            ids = [uuid.uuid4().hex for _ in range(n)]
            for k, (rid, p) in enumerate(zip(ids, prompts(n))):
                send(sock, AddRequest(rid, p, SamplingParams(temperature=1.0, seed=k, max_tokens=max_tokens,
                                                             ignore_eos=True), [2], time.time()))
            left, stats, per_step, per_cpu = set(ids), {}, [], []
            while left:
                if not sock.poll(300_000):
                    raise TimeoutError("no output from the scheduler (is it up?)")
                batch = decode(sock.recv_multipart())
                if isinstance(batch, OutputBatch):
                    # every step's batch carries the counters: one more turnaround each decode step
                    if stats and batch.stats.get("turnarounds", 0) == stats.get("turnarounds", 0) + 1:
                        per_step.append(batch.stats["turnaround_total"] - stats.get("turnaround_total", 0.0))
                        per_cpu.append(batch.stats["turnaround_cpu_total"] - stats.get("turnaround_cpu_total", 0.0))
                    stats = batch.stats
                    left -= {o.request_id for o in batch.outputs if o.finished}
            return stats, (per_step, per_cpu)

        run(1, 2)  # warm-up: waits for start-up too
        n = mean_ms = cpu_mean_ms = step_ms = 0.0
        per_step, per_cpu = [], []
        for _ in range(runs):
            before, _ = run(seqs, 2)  # the prefills; after this only the measured decode steps differ
            after, (steps, cpus) = run(seqs, tokens)
            per_step += steps
            per_cpu += cpus
            k = after["turnarounds"] - before["turnarounds"]
            n += k
            mean_ms += 1e3 * (after["turnaround_total"] - before["turnaround_total"])
            cpu_mean_ms += 1e3 * (after["turnaround_cpu_total"] - before["turnaround_cpu_total"])
            step_ms += 1e3 * (after["step_time_total"] - before["step_time_total"]) / (after["steps"] - before["steps"])
        return {"turnarounds": n, "mean_ms": mean_ms / n,
                "median_ms": 1e3 * statistics.median(per_step), "p90_ms": 1e3 * pct(per_step, 0.9),
                "samples": len(per_step),
                # the scheduler thread's CPU time in the same windows: wall minus this is waiting for a core
                "cpu_median_ms": 1e3 * statistics.median(per_cpu), "cpu_p90_ms": 1e3 * pct(per_cpu, 0.9),
                "cpu_mean_ms": cpu_mean_ms / n, "step_ms": step_ms / runs}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--turnaround-runs", type=int, default=1,
                    help="batches of 64 requests x 64 tokens the turnaround is measured over (63 samples each)")
    ap.add_argument("--only", default="codec,turnaround,broadcast,serve",
                    help="comma-separated parts to run (codec, turnaround, broadcast, serve)")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    rows = []
    if "codec" in parts:
        say("codec ...")
        c = codec_cost()
        rows += [("encode + decode, OutputBatch of 256 outputs", f"{c['batch256']:.3f} ms", "<= 0.2 ms"),
                 ("  the same with top-5 logprobs each", f"{c['batch256_top5']:.3f} ms", "-"),
                 ("encode + decode, StepPlan of 64 sequences", f"{c['plan64']:.3f} ms", "-"),
                 ("encode + decode, StepResult of 64 sequences", f"{c['result64']:.3f} ms", "-")]
    if "turnaround" in parts:
        say("scheduler turnaround at 64 running sequences ...")
        t = scheduler_turnaround(runs=args.turnaround_runs)
        rows += [(f"scheduler: results -> next plan, 64 running (median of {t['samples']})",
                  f"{t['median_ms']:.3f} ms", "<= 0.5 ms"),
                 ("  p90 / mean", f"{t['p90_ms']:.3f} / {t['mean_ms']:.3f} ms", "-"),
                 ("  its CPU time in them: median / p90 / mean",
                  f"{t['cpu_median_ms']:.3f} / {t['cpu_p90_ms']:.3f} / {t['cpu_mean_ms']:.3f} ms", "-"),
                 ("  step, plan out to results in (same run)", f"{t['step_ms']:.2f} ms", "-")]
    if "broadcast" in parts:
        say("broadcast acked by 4 workers ...")
        b = broadcast_latency()
        rows += [("broadcast acked by 4 workers, p50", f"{b['p50_ms']:.2f} ms", "-"),
                 ("broadcast acked by 4 workers, p99", f"{b['p99_ms']:.2f} ms", "< 5 ms")]
    if "serve" in parts:
        rows += serve_rows(args.cycles)
    w = max(len(a) for a, _, _ in rows)
    print(f"\n{'measure'.ljust(w)}  {'value':>12}  bar")
    for a, v, bar in rows:
        print(f"{a.ljust(w)}  {v:>12}  {bar}")


def serve_rows(cycles: int) -> list[tuple[str, str, str]]:
    r = serve_benchmarks(cycles)
    return [
        ("/pause?mode=abort, 64 running", f"{r['pause_abort_ms']:.1f} ms", "< 50 ms"),
        ("/resume", f"{r['resume_ms']:.1f} ms", "< 10 ms"),
        ("level 2: released / (weights + KV)", f"{100 * r['level2_released_frac']:.1f} %", ">= 90 %"),
        ("level 2: RSS drop / (weights + KV in RAM)", f"{100 * r['level2_rss_drop_frac']:.1f} %", "-"),
        (f"{cycles} cycles: RSS drift", f"{100 * r['cycles_rss_drift_frac']:+.2f} %", "within 5 %"),
        (f"{cycles} cycles: RSS max", f"{100 * r['cycles_rss_max_frac']:+.2f} %", "-"),
        ("wake from level 1", f"{r['wake1_ms']:.1f} ms", f"<= 2 x memcpy ({2 * r['memcpy_weights_ms']:.1f} ms)"),
        ("memcpy of the weight bytes", f"{r['memcpy_weights_ms']:.1f} ms", "-"),
    ]


if __name__ == "__main__":
    main()
