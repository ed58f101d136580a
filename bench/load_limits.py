"""A burst of concurrent streaming clients against `rollbus serve --max-num-queued-reqs`: how many streams end
with [DONE], how many get 503 + Retry-After, how many hang, and the gateway's RSS before and after.

    python -m bench.load_limits --clients 300 --max-num-queued-reqs 128
(a tiny random llama with SmolLM2's tokenizer; SmolLM2 must be cached, as for the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one(client: httpx.AsyncClient, url: str, max_tokens: int, timeout_s: float) -> str:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code == 503:
                    await r.aread()
                    return "503+retry-after" if r.headers.get("retry-after") else "503"
                last = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line[6:]
                        if last != "[DONE]" and "error" in json.loads(last):
                            return "error chunk"
                return "done" if last == "[DONE]" else f"ended without [DONE] ({r.status_code})"
    except TimeoutError:
        return "hung"
    except httpx.HTTPError as e:
        return type(e).__name__


async def burst(url: str, clients: int, max_tokens: int, timeout_s: float) -> Counter:
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        results = await asyncio.gather(*(one(client, url, max_tokens, timeout_s) for _ in range(clients)))
    return Counter(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--max-num-queued-reqs", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    from engine.model_store import resolve_model
    from tests.server_helpers import start_server, tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="rollbus-load-"))
    folder = tiny_model_with_tokenizer("llama", work / "m", resolve_model(None, progress=False), vocab_size=49152)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--max-num-queued-reqs", str(args.max_num_queued_reqs), "--disable-uvicorn-access-log")
    try:
        gw = s.child_pids()["gateway"]
        httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2}, timeout=60)
        base = rss_mb(gw)
        print(f"clients={args.clients} max_num_queued_reqs={args.max_num_queued_reqs} max_tokens={args.max_tokens}")
        print(f"gateway RSS baseline {base:.0f} MB")
        for i in range(args.rounds):
            t0 = time.monotonic()
            counts = asyncio.run(burst(s.url, args.clients, args.max_tokens, args.timeout_s))
            print(f"round {i + 1}: {dict(counts)} in {time.monotonic() - t0:.1f}s; gateway RSS {rss_mb(gw):.0f} MB")
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2}, timeout=60)
        print(f"afterwards a request gets {r.status_code}")
    finally:
        print(f"rollbus serve exit code after SIGINT: {s.stop()}")


if __name__ == "__main__":
    main()
