"""The 1,000-stream soak of issue 11: N streaming clients kept up for a fixed time against `rollbus serve
--max-num-queued-reqs`, each re-sending as soon as its stream ends (after Retry-After when it got a 503);
a share of them hang up mid-stream. Counts how every stream ended and follows the RSS of the gateway,
the scheduler and the worker.

    python -m bench.soak --clients 1000 --duration-s 60 --max-num-queued-reqs 256
(a tiny random llama with SmolLM2's tokenizer; SmolLM2 must be cached, as for the tests)

Baseline: the RSS after a warm-up phase of the same clients and request shapes (--warmup-s), once the
engine is idle again. What a process allocates the first time it serves 1,000 connections (uvicorn's
per-connection objects, the allocator's arenas, the tokenizer's caches, the heap a burst of streams
grows into) is not a leak; what keeps growing from there on is. "after" is the RSS once the soak's
streams have all ended and the engine reports nothing running or waiting. The bar: every stream ends
with [DONE] or a 503, none hangs, the gateway's "after" within 10 % of its baseline. A stream still open
after --stream-timeout-s is "hung" if it had started (tokens came, then stopped) and "timed out queued"
if no token came yet: it waited in the engine's queue longer than the client would (the queue bound,
--max-num-queued-reqs, is what keeps that wait within a client's deadline).

The clients speak HTTP/1.1 over raw asyncio streams (one connection per request): httpx on the same two
cores would take more CPU than the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ENDINGS = ("done", "503", "error+done", "client hung up", "hung", "timed out queued", "lost")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    lost_why: Counter = field(default_factory=Counter)
    active: int = 0
    no_retry_after: int = 0


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader):
    """The payloads of a chunked body (uvicorn streams SSE that way)."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def one_stream(host: str, port: int, body: bytes, hang_up: bool, tally: Tally,
                     progress: list[int]) -> tuple[str, float]:
    """One streaming request; returns how it ended and the Retry-After to honour (0 if none). progress[0]
    counts the data events received (a stream cut by the deadline before its first one was queued)."""
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        status, headers = await _read_head(reader)
        if status == 503:
            retry = headers.get("retry-after")
            if retry is None:
                tally.no_retry_after += 1
            return "503", float(retry or 1)
        if status != 200:
            tally.lost_why[f"HTTP {status}"] += 1
            return "lost", 0.0
        buf, last, errored = b"", b"", False
        async for data in _chunks(reader):
            if hang_up:
                return "client hung up", 0.0
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    progress[0] += 1
                    last = event[6:]
                    if last != b"[DONE]" and b'"error"' in last[:12]:
                        errored = True
        if last == b"[DONE]":
            return ("error+done" if errored else "done"), 0.0
        tally.lost_why["ended without [DONE]"] += 1
        return "lost", 0.0
    finally:
        writer.close()


async def client(host: str, port: int, body: bytes, until: float, hang_up_share: float, stream_timeout_s: float,
                 tally: Tally, rng: random.Random) -> None:
    await asyncio.sleep(rng.random() * 0.5)  # not all in the same millisecond
    while time.monotonic() < until:
        tally.active += 1
        wait = 0.0
        progress = [0]
        try:
            async with asyncio.timeout(stream_timeout_s):
                ending, wait = await one_stream(host, port, body, rng.random() < hang_up_share, tally, progress)
        except TimeoutError:  # still waiting in the engine's queue, or stuck after its first tokens
            ending = "hung" if progress[0] else "timed out queued"
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            ending = "lost"
            tally.lost_why[type(e).__name__] += 1
        finally:
            tally.active -= 1
        tally.counts[ending] += 1
        if wait:
            await asyncio.sleep(wait * (0.5 + rng.random()))  # Retry-After, with jitter


async def phase(host: str, port: int, body: bytes, clients: int, duration_s: float, hang_up_share: float,
                stream_timeout_s: float, pids: dict[str, int], samples: list, label: str) -> Tally:
    tally = Tally()
    t0 = time.monotonic()
    until = t0 + duration_s
    rng = random.Random(0)
    tasks = [asyncio.create_task(client(host, port, body, until, hang_up_share, stream_timeout_s, tally,
                                        random.Random(rng.random()))) for _ in range(clients)]
    next_print = t0
    while not all(t.done() for t in tasks):
        now = time.monotonic()
        rss = {role: rss_mb(pid) for role, pid in pids.items()}
        samples.append((label, round(now - t0, 2), rss))
        if now >= next_print:
            c = tally.counts
            print(f"  [{label} {now - t0:5.1f}s] open {tally.active:4d}  done {c['done']:6d}  503 {c['503']:6d}  "
                  f"hung-up {c['client hung up']:5d}  err {c['error+done']:3d}  lost {c['lost']:3d}  "
                  f"hung {c['hung']:3d}  queued>timeout {c['timed out queued']:3d}  gateway {rss['gateway']:.0f} MB",
                  flush=True)
            next_print += 5.0
        await asyncio.sleep(0.5)
    for t in tasks:
        t.result()  # a bug in the bench itself surfaces here
    return tally


def engine_idle(url: str) -> tuple[bool, dict[str, float]]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "rollbus_gateway_open_sequences",
                 "rollbus_gateway_open_engine_requests"):
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        if m:
            values[name] = float(m.group(1))
    return all(v == 0 for v in values.values()), values


def settle(url: str, pids: dict[str, int], timeout_s: float = 30.0) -> tuple[dict[str, float], dict[str, float]]:
    """Wait until the engine and the gateway hold no request, then a second more; the RSS then."""
    deadline = time.monotonic() + timeout_s
    idle, values = engine_idle(url)
    while not idle and time.monotonic() < deadline:
        time.sleep(0.5)
        idle, values = engine_idle(url)
    time.sleep(1.0)
    return {role: rss_mb(pid) for role, pid in pids.items()}, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--max-num-queued-reqs", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hang-up-share", type=float, default=0.1, help="share of streams the client drops mid-way")
    ap.add_argument("--stream-timeout-s", type=float, default=120.0, help="a stream still open after this is hung")
    ap.add_argument("--json", help="write the counts and RSS samples to this file")
    ap.add_argument("--plot", help="RSS over time as a PNG (needs matplotlib)")
    ap.add_argument("serve_args", nargs="*", help="extra `rollbus serve` flags (after --)")
    args = ap.parse_args()
    import httpx

    from engine.model_store import resolve_model
    from tests.server_helpers import start_server, tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="rollbus-soak-"))
    folder = tiny_model_with_tokenizer("llama", work / "m", resolve_model(None, progress=False), vocab_size=49152)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--max-num-queued-reqs", str(args.max_num_queued_reqs), "--disable-uvicorn-access-log",
                     *args.serve_args)
    samples: list = []
    try:
        pids = {role: pid for role, pid in s.child_pids().items() if role in ("gateway", "scheduler", "worker-0")}
        body = json.dumps({"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog, again and",
                           "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}).encode()
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        start = {role: rss_mb(pid) for role, pid in pids.items()}
        print(f"clients={args.clients} duration={args.duration_s:.0f}s warm-up={args.warmup_s:.0f}s "
              f"max_num_queued_reqs={args.max_num_queued_reqs} max_tokens={args.max_tokens} "
              f"hang-up share={args.hang_up_share}")
        print(f"RSS at start (MB): {', '.join(f'{k} {v:.0f}' for k, v in start.items())}")
        host, port = "127.0.0.1", s.port
        warm = asyncio.run(phase(host, port, body, args.clients, args.warmup_s, args.hang_up_share,
                                 args.stream_timeout_s, pids, samples, "warm-up"))
        base, _ = settle(s.url, pids)
        print(f"warm-up: {dict(warm.counts)}; baseline RSS (MB): {', '.join(f'{k} {v:.0f}' for k, v in base.items())}")
        t0 = time.monotonic()
        soak = asyncio.run(phase(host, port, body, args.clients, args.duration_s, args.hang_up_share,
                                 args.stream_timeout_s, pids, samples, "soak"))
        wall = time.monotonic() - t0
        after, idle_values = settle(s.url, pids)
        peak = {role: max(rss[role] for label, _, rss in samples if label == "soak") for role in pids}
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2}, timeout=60)
        c = soak.counts
        ended = sum(c.values())
        print(f"\nsoak: {args.clients} clients for {args.duration_s:.0f}s ({wall:.1f}s until the last stream ended), "
              f"{ended} streams")
        print("| ending | streams |\n|---|---|")
        for k in ENDINGS:
            print(f"| {k} | {c[k]} |")
        if soak.lost_why:
            print(f"lost: {dict(soak.lost_why)}")
        print(f"503 without Retry-After: {soak.no_retry_after}")
        print("\n| process | start MB | baseline MB | soak peak MB | after MB | after / baseline |")
        print("|---|---|---|---|---|---|")
        for role in pids:
            print(f"| {role} | {start[role]:.0f} | {base[role]:.0f} | {peak[role]:.0f} | {after[role]:.0f} | "
                  f"{after[role] / base[role]:.3f} |")
        print(f"\nafter the soak: {idle_values}; a new request gets {r.status_code}")
        ok = c["hung"] + c["timed out queued"] == 0 and c["lost"] == 0 and after["gateway"] <= 1.10 * base["gateway"]
        print(f"bar (0 hung or timed out, 0 lost, gateway after <= 1.10 x baseline): {'met' if ok else 'NOT met'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "counts": dict(c), "start": start,
                                                   "baseline": base, "peak": peak, "after": after,
                                                   "samples": samples}, indent=1))
        if args.plot:
            _plot(samples, args.plot)
    finally:
        print(f"rollbus serve exit code after SIGINT: {s.stop()}")


def _plot(samples: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    offset, t_prev, xs = 0.0, None, []
    for label, t, _ in samples:  # the soak's clock continues the warm-up's
        if t_prev is not None and t < t_prev:
            offset += t_prev
        xs.append(offset + t)
        t_prev = t
    for role in samples[0][2]:
        ax.plot(xs, [rss[role] for _, _, rss in samples], label=role)
    ax.set_xlabel("s (warm-up, then soak)")
    ax.set_ylabel("RSS MB")
    ax.legend()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
