"""The multi-turn and long-prompt workloads of bench/rollout.py, run the same way against any OpenAI-compatible
server (rollbus or vLLM) over HTTP, tokens in and tokens out (`return_token_ids`), so both engines compute the
same tokens:

  M  agentic multi-turn: conversations x turns; each turn sends the whole conversation so far (the previous
     prompt, the reply and a tool result of `tool_tokens` tokens) and generates exactly `reply_tokens`;
     conversations run concurrently, turns one after another. Throughput, TTFT p50/p99, and the prefix-cache
     hit rate against the ideal (every token of the previous turn's prompt and reply reused).
  L  long prompts: `prompts` distinct prompts of `prompt_len` tokens submitted at once, `new_tokens` each:
     prefill throughput (prompt tokens / time until the last first token) and TTFT; then the same prompts
     arriving while `streams` short streams decode: those streams' inter-token latency p50/p99 while the long
     prompts are being prefilled (chunked prefill must not stall them).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx

WIDE = (256, 4, 128)  # the wide workload: prompts, n, new tokens
AGENTIC = (32, 4, 64, 64)  # workload M: conversations, turns, reply tokens, tool-result tokens per turn
LONG = (16, 2048, 32, 32, 256)  # workload L: prompts, prompt tokens, new tokens; decoding streams, their tokens


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def prefix_cache_tokens(url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens so far, from /metrics (vLLM's counter names; rollbus serves the same)."""
    queries = hits = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"):
            queries += float(line.rsplit(" ", 1)[1])
        elif name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"):
            hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def stream_tokens(h: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                        stamps: list[float] | None = None) -> tuple[float, list[int]]:
    """One streamed completion of exactly max_tokens: (time to first token, the generated token ids); each
    chunk's arrival time is appended to `stamps` when given."""
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    async with h.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/completions: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"]
            new = got[0].get("token_ids") or [] if got else []
            if new:
                now = time.perf_counter()
                first = first if first is not None else now - t0
                if stamps is not None:
                    stamps.append(now)
                ids += new
    if len(ids) != max_tokens:
        raise RuntimeError(f"{len(ids)} tokens streamed, expected exactly {max_tokens} (return_token_ids)")
    return first, ids


def agentic(url: str, model: str, starts: list[list[int]], turns: int, reply_tokens: int, tool_tokens: int,
            vocab: range) -> dict:
    """Workload M (see the module doc). `starts`: each conversation's first prompt; tool results are seeded
    random tokens from `vocab`, the same for every engine."""
    async def conversation(h: httpx.AsyncClient, c: int, prompt: list[int], out: dict) -> None:
        rng = random.Random(c)
        for t in range(turns):
            ttft, reply = await stream_tokens(h, model, prompt, reply_tokens)
            out["ttft"].append(ttft)
            out["tokens"] += len(reply)
            if t:
                out["ideal"] += out["prev"][c]
            out["prompt_tokens"] += len(prompt)
            out["prev"][c] = len(prompt) + len(reply)
            prompt = prompt + reply + [rng.choice(vocab) for _ in range(tool_tokens)]

    async def run() -> dict:
        out = {"ttft": [], "tokens": 0, "ideal": 0, "prompt_tokens": 0, "prev": {}}
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=256)) as h:
            t0 = time.perf_counter()
            await asyncio.gather(*[conversation(h, c, p, out) for c, p in enumerate(starts)])
            out["seconds"] = time.perf_counter() - t0
        return out

    q0, h0 = prefix_cache_tokens(url)
    out = asyncio.run(run())
    q1, h1 = prefix_cache_tokens(url)
    hit = h1 - h0
    return {"tokens": out["tokens"], "seconds": out["seconds"], "tok_s": out["tokens"] / out["seconds"],
            "ttft_ms_p50": 1e3 * statistics.median(out["ttft"]), "ttft_ms_p99": 1e3 * pct(out["ttft"], 0.99),
            "cache_hit_tokens": hit, "cache_queried_tokens": q1 - q0, "ideal_hit_tokens": out["ideal"],
            "hit_of_ideal": hit / out["ideal"] if out["ideal"] else None}


CALM_GAPS = 8  # workload L: the gaps each stream decodes before the long prompts arrive


def long_prompts(url: str, model: str, prompts: list[list[int]], new_tokens: int, short: list[int], streams: int,
                 stream_tokens_n: int) -> dict:
    """Workload L (see the module doc). `prompts` must be distinct (nothing cached); `short`: the running
    streams' prompt."""
    async def burst(h: httpx.AsyncClient) -> tuple[list[float], float]:
        res = await asyncio.gather(*[stream_tokens(h, model, p, new_tokens) for p in prompts])
        ttfts = [r[0] for r in res]
        return ttfts, max(ttfts)

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=256)) as h:
            alone, last = await burst(h)
            out = {"prefill_tok_s": sum(map(len, prompts)) / last, "ttft_ms_p50": 1e3 * statistics.median(alone),
                   "ttft_ms_max": 1e3 * max(alone)}
            # the same prompt lengths again (shifted ids: nothing cached) while `streams` streams decode
            stamps: list[list[float]] = [[] for _ in range(streams)]
            running = [asyncio.create_task(stream_tokens(h, model, short, stream_tokens_n, stamps[i]))
                       for i in range(streams)]
            # every stream decoding, with CALM_GAPS inter-token gaps each, before the long prompts arrive: the
            # calm ITL they are compared with (with one token each it came from a handful of gaps)
            while min(map(len, stamps)) <= CALM_GAPS:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            shifted = [[(t + 1) % 30000 + 1000 for t in p] for p in prompts]
            await asyncio.gather(*[stream_tokens(h, model, p, new_tokens) for p in shifted])
            end = time.perf_counter()
            await asyncio.gather(*running)
            during = [b - a for s in stamps for a, b in zip(s, s[1:]) if start <= b <= end]
            calm = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < start]
            out.update({"itl_ms_p50_during": 1e3 * statistics.median(during) if during else None,
                        "itl_ms_p99_during": 1e3 * pct(during, 0.99) if during else None,
                        "itl_ms_p50_before": 1e3 * statistics.median(calm) if calm else None,
                        "itl_samples_during": len(during)})
            return out

    return asyncio.run(run())


def distinct_prompts(n: int, length: int, vocab: range, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]
