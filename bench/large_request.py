"""How long one large request blocks the gateway's event loop: a probe asks GET /version (answered by
the loop alone) and GET /health (a round trip to every engine process) every 50 ms while one request as
large as the limits allow is sent, and the worst probe latencies are printed per request shape.

    python -m bench.large_request
    python -m bench.large_request --max-request-body-bytes 8388608 --shapes text-refused
(a tiny random llama with SmolLM2's tokenizer; SmolLM2 must be cached, as for the tests)

Shapes (at the limits: --max-request-body-bytes, --max-prompts-per-request, --max-prompt-tokens-per-request):
  text-refused   as many text prompts as allowed, filling the body: more tokens than allowed, so 400
  ids-refused    token-id prompts filling the body: more tokens than allowed, so 400 after parsing
  text-served    as many ten-token text prompts as allowed, max_tokens 1 (issue 11's 600,000-prompt request,
                 capped by --max-prompts-per-request): served
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

WORD = "fox "  # one token in SmolLM2's vocabulary, four bytes


def _json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def body_for(shape: str, body_bytes: int, prompts: int) -> bytes:
    if shape == "text-refused":
        per = max(1, (body_bytes - 200) // prompts - 4)
        text = (WORD * (per // len(WORD) + 1))[:per]
        return _json({"model": "tiny", "prompt": [text] * prompts, "max_tokens": 1})
    if shape == "ids-refused":
        per = max(1, (body_bytes - 200) // prompts // 6 - 1)  # "12345," is 6 bytes
        return _json({"model": "tiny", "prompt": [[12345] * per] * prompts, "max_tokens": 1})
    if shape == "text-served":
        return _json({"model": "tiny", "prompt": [WORD * 10] * prompts, "max_tokens": 1})
    raise ValueError(shape)


async def probe(url: str, path: str, stop: asyncio.Event, out: list[float], every_s: float = 0.05) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            await client.get(url + path)
            out.append(time.monotonic() - t0)
            await asyncio.sleep(every_s)


async def measure(url: str, body: bytes) -> dict:
    """Send `body` to /v1/completions while probing; the worst and median probe latencies."""
    stop = asyncio.Event()
    version: list[float] = []
    health: list[float] = []
    probes = [asyncio.create_task(probe(url, "/version", stop, version)),
              asyncio.create_task(probe(url, "/health", stop, health))]
    await asyncio.sleep(0.5)  # probes warm
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=900) as client:
        r = await client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    took = time.monotonic() - t0
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*probes)
    message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
    return {"status": r.status_code, "message": message[:90], "request_s": took,
            "version_max_s": max(version), "version_p50_s": statistics.median(version),
            "health_max_s": max(health), "probes": len(version)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024)
    ap.add_argument("--max-prompts-per-request", type=int, default=4096)
    ap.add_argument("--shapes", nargs="+", default=["text-refused", "ids-refused", "text-served"])
    args = ap.parse_args()
    from engine.model_store import resolve_model
    from tests.procstats import rss
    from tests.server_helpers import start_server, tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="rollbus-large-"))
    folder = tiny_model_with_tokenizer("llama", work / "m", resolve_model(None, progress=False), vocab_size=49152)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--max-request-body-bytes", str(args.max_request_body_bytes),
                     "--max-prompts-per-request", str(args.max_prompts_per_request), "--disable-uvicorn-access-log")
    try:
        gw = s.child_pids()["gateway"]
        print(f"limits: body {args.max_request_body_bytes} bytes, {args.max_prompts_per_request} prompts, "
              f"default tokens per request")
        print("| shape | body MB | status | request s | /version max ms | /version p50 ms | /health max ms | "
              "gateway RSS MB before / after |")
        print("|---|---|---|---|---|---|---|---|")
        for shape in args.shapes:
            body = body_for(shape, args.max_request_body_bytes, args.max_prompts_per_request)
            before = rss(gw) / 2**20
            m = asyncio.run(measure(s.url, body))
            print(f"| {shape} | {len(body) / 2**20:.1f} | {m['status']} | {m['request_s']:.2f} | "
                  f"{m['version_max_s'] * 1000:.0f} | {m['version_p50_s'] * 1000:.0f} | "
                  f"{m['health_max_s'] * 1000:.0f} | "
                  f"{before:.0f} / {rss(gw) / 2**20:.0f} |", flush=True)
            if m["message"]:
                print(f"    ({m['message']})")
    finally:
        s.stop()


if __name__ == "__main__":
    main()
