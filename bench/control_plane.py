"""Control-plane benchmark (issue: RL control plane): how fast the acknowledged broadcasts are, and
what sleep gives back.

  1. one control broadcast acked by 4 worker processes (real coordinator, real sockets): p50/p99
  2. /pause?mode=abort with 64 running requests, and /resume, on `rollbus serve` (SmolLM2)
  3. sleep level 2: bytes released against weights + KV; RSS over 50 sleep/wake cycles;
     waking from level 1 against one memcpy of the weight bytes in the same run

    python bench/control_plane.py [--cycles 50]
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
from engine.procstats import mapping_rss, rss  # noqa: E402
from engine.serve_process import start_server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MEMBER = """
import sys, time, zmq
from bus.endpoints import Endpoints
from bus.member import MemberLink
from engine.config import EngineConfig
ep = Endpoints.from_config(EngineConfig(bus_dir=sys.argv[1]))
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
    cfg = EngineConfig(bus_dir=work)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=50)
    args = ap.parse_args()
    say("broadcast acked by 4 workers ...")
    b = broadcast_latency()
    r = serve_benchmarks(args.cycles)
    rows = [
        ("broadcast acked by 4 workers, p50", f"{b['p50_ms']:.2f} ms", "-"),
        ("broadcast acked by 4 workers, p99", f"{b['p99_ms']:.2f} ms", "< 5 ms"),
        ("/pause?mode=abort, 64 running", f"{r['pause_abort_ms']:.1f} ms", "< 50 ms"),
        ("/resume", f"{r['resume_ms']:.1f} ms", "< 10 ms"),
        ("level 2: released / (weights + KV)", f"{100 * r['level2_released_frac']:.1f} %", ">= 90 %"),
        ("level 2: RSS drop / (weights + KV in RAM)", f"{100 * r['level2_rss_drop_frac']:.1f} %", "-"),
        (f"{args.cycles} cycles: RSS drift", f"{100 * r['cycles_rss_drift_frac']:+.2f} %", "within 5 %"),
        (f"{args.cycles} cycles: RSS max", f"{100 * r['cycles_rss_max_frac']:+.2f} %", "-"),
        ("wake from level 1", f"{r['wake1_ms']:.1f} ms", f"<= 2 x memcpy ({2 * r['memcpy_weights_ms']:.1f} ms)"),
        ("memcpy of the weight bytes", f"{r['memcpy_weights_ms']:.1f} ms", "-"),
    ]
    w = max(len(a) for a, _, _ in rows)
    print(f"\n{'measure'.ljust(w)}  {'value':>12}  bar")
    for a, v, bar in rows:
        print(f"{a.ljust(w)}  {v:>12}  {bar}")


if __name__ == "__main__":
    main()
