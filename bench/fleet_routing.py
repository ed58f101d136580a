"""Routing a multi-turn workload over two `rollbus serve` engines with vllm-router: prefix-cache hit rate and
throughput of `kv_aware` (fed by the engines' KV events, --kv-events-config), `consistent_hash` (by the
X-Session-ID header) and `round_robin`, in the same run, on the same engines.

    bash tests/interop/setup_venvs.sh router       # vllm-router 0.1.17 into ~/.cache/rollbus-fleet/router
    python bench/fleet_routing.py                  # tiny Qwen3 (SmolLM2's tokenizer), 32 conversations x 4 turns
    python bench/fleet_routing.py --model ~/.cache/rollbus/models/SmolLM2-135M-Instruct --json out.json

The workload: N conversations run at once, each T turns in order; turn t's prompt is turn t-1's prompt, its
completion and a new user message (a completion request with a text prompt, as an agent loop that keeps its
transcript sends), after a system prompt every conversation shares. Every policy gets conversations of its
own (different words, its own system prompt), so no policy finds another's prefixes in the cache.

Columns: `hit` is the prompt tokens served from the prefix cache over all prompt tokens (each response's
usage.prompt_tokens_details.cached_tokens); `ideal` is what one engine with an unbounded cache would have
reused: per request, the longest token prefix it shares with what was computed before it was sent (the
prompts of earlier requests, and the completion tokens of finished ones but their last), in whole blocks, at
most every prompt token but the last;
`of ideal` is hit / ideal (bar for kv_aware: >= 90%). `held` is what the best engine held by its own KV
events (a second subscriber, bench/kv_event_view.py) when each request was sent, over the ideal: what a router
reading those events could credit; `moved` is the part of it that the engine the router picked did not
reuse (a routing choice: the events had announced the prefix elsewhere). Throughput is requests and completion
tokens per second of the policy's whole run; `split` is how many requests each engine served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_event_view import KVEventView  # noqa: E402
from tests.router_process import SETUP, router_binary, start_router  # noqa: E402
from tests.serve_process import free_port, start_server  # noqa: E402
from tests.server_helpers import metric  # noqa: E402

# kv_aware_affinity: kv_aware with vllm-router's --kv-aware-session-affinity-ttl-secs (by X-Session-ID)
POLICIES = ("round_robin", "consistent_hash", "kv_aware", "kv_aware_affinity")
WORDS = ("apple river stone cloud engine garden lantern window copper meadow signal harbor pencil violet thunder "
         "marble orbit canyon feather rocket silver puzzle island castle velvet bridge candle forest glacier "
         "compass shadow whistle ember mosaic falcon").split()


def user_message(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def tiny_qwen3(folder: Path) -> Path:
    """The tiny random Qwen3 of the tests with SmolLM2's tokenizer beside it (text prompts work)."""
    from engine.model_store import resolve_model
    from tests.server_helpers import tiny_model_with_tokenizer

    if not (folder / "config.json").is_file():
        tiny_model_with_tokenizer("qwen3", folder, resolve_model(None, progress=False), vocab_size=49152,
                                  max_position_embeddings=4096)
    return folder


def start_engines(workdir: Path, model: Path, n: int, kv_bytes: int, block_size: int) -> list[tuple[object, str]]:
    """n engines, each publishing KV events on a loopback-reachable port: [(server, its event endpoint)]."""
    out = []
    for _ in range(n):
        port = free_port()
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        server = start_server(workdir, str(model), "--enable-scale-out", "--return-tokens-as-token-ids",
                              "--kv-events-config", cfg,
                              "--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(block_size),
                              "--max-model-len", "4096", env={"OMP_NUM_THREADS": "1"})
        out.append((server, f"tcp://127.0.0.1:{port}"))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: str, headers: dict,
                   args: argparse.Namespace) -> tuple[str, list[int], dict]:
    """One completion through the router: (text, completion token ids, usage), streamed with --stream."""
    req = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "logprobs": 0}
    if not args.stream:
        r = await client.post(url + "/v1/completions", headers=headers, json=req)
        r.raise_for_status()
        body = r.json()
        choice = body["choices"][0]
        return choice["text"], [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]], body["usage"]
    req |= {"stream": True, "stream_options": {"include_usage": True}}
    text, tokens, usage = [], [], {}
    async with client.stream("POST", url + "/v1/completions", headers=headers, json=req) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text.append(choice["text"])
                tokens += (choice.get("logprobs") or {}).get("tokens") or []
    return "".join(text), [int(t.split(":", 1)[1]) for t in tokens], usage


async def run_policy(url: str, tokenize_url: str, model: str, tag: str, args: argparse.Namespace,
                     view: KVEventView, engine_urls: list[str]) -> dict:
    """Every conversation of this policy's workload through the router at `url`."""
    rng = random.Random(f"{tag}-{args.seed}")
    system = f"System ({tag}): " + user_message(rng, args.system_words) + "\n"
    # what an engine may hold when a request arrives: every earlier request's prompt (its blocks are findable
    # once prefilled), and for finished ones the completion tokens whose KV was computed too
    computed: list[list[int]] = []
    rows: list[dict] = []

    async def conversation(client: httpx.AsyncClient, c: int) -> None:
        crng = random.Random(f"{tag}-{args.seed}-{c}")
        prompt = system
        for t in range(args.turns):
            prompt += f"User: {user_message(crng, args.user_words)}\nAssistant:"
            # token ids without return_token_ids (vllm-router 0.1.17's kv_aware scores nothing for requests
            # that carry it): the prompt's from an engine's /tokenize, the completion's from its logprobs
            # (the engines run with --return-tokens-as-token-ids)
            tok = await client.post(tokenize_url, json={"model": model, "prompt": prompt})
            ids = tok.json()["tokens"]
            best = max((common_prefix(ids, x) for x in computed), default=0)
            computed.append(ids)
            held = max(view.reusable(u, ids) for u in engine_urls)  # the most any engine holds, by its events
            text, out_ids, usage = await complete(client, url, model, prompt, {"X-Session-ID": f"{tag}-conv-{c}"},
                                                  args)
            ideal = min(best, len(ids) - 1) // args.block_size * args.block_size
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append({"conv": c, "turn": t, "prompt": len(ids), "cached": cached, "ideal": ideal,
                         "held": held, "completion": len(out_ids)})
            computed.append(ids + out_ids[:-1])
            prompt += text + "\n"

    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in range(args.conversations)))
        wall = time.perf_counter() - start
    prompt = sum(r["prompt"] for r in rows)
    hit = sum(r["cached"] for r in rows) / prompt
    ideal = sum(r["ideal"] for r in rows) / prompt
    # held: what the best engine held by its events when each request was sent (the events' ceiling for a
    # router); moved: what the engine the router picked reused less than that (a routing choice, not an event)
    held = sum(r["held"] for r in rows) / prompt
    moved = sum(max(r["held"] - r["cached"], 0) for r in rows) / prompt
    def of_ideal(x: float) -> float:
        return x / ideal if ideal else float("nan")

    return {"requests": len(rows), "prompt_tokens": prompt, "hit": hit, "ideal": ideal, "of_ideal": of_ideal(hit),
            "held_of_ideal": of_ideal(held), "moved_of_ideal": of_ideal(moved), "wall_s": wall,
            "req_s": len(rows) / wall, "completion_tok_s": sum(r["completion"] for r in rows) / wall, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an HF folder with a tokenizer (default: tiny Qwen3)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=20)
    ap.add_argument("--user-words", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-bytes", type=int, default=256 * 1024 * 1024, help="each engine's KV cache")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--kv-affinity-ttl", type=int, default=60, metavar="S",
                    help="kv_aware_affinity: vllm-router's --kv-aware-session-affinity-ttl-secs S (X-Session-ID)")
    ap.add_argument("--stream", action="store_true",
                    help="stream every completion (vllm-router's kv_aware stops counting a request's prompt as "
                         "pending prefill at its first streamed token; a non-streamed one counts until it ends)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if router_binary() is None:
        raise SystemExit(f"vllm-router is not installed: {SETUP}")
    with tempfile.TemporaryDirectory(prefix="fleet-routing-") as tmp:
        work = Path(tmp)
        model = args.model or tiny_qwen3(Path(os.environ.get("ROLLBUS_FLEET_MODEL", work / "tiny-qwen3")))
        engines = start_engines(work, model, args.engines, args.kv_bytes, args.block_size)
        urls = [s.url for s, _ in engines]
        view = KVEventView({s.url: ep for s, ep in engines}, args.block_size)
        results = {}
        try:
            for policy in args.policies:
                kv = {s.url: ep for s, ep in engines} if policy.startswith("kv_aware") else None
                extra = ("--kv-aware-session-affinity-ttl-secs", str(args.kv_affinity_ttl)) \
                    if policy == "kv_aware_affinity" else ()
                router = start_router(work, urls, policy.removesuffix("_affinity"), kv_sources=kv, model=str(model),
                                      block_size=args.block_size, extra=extra)
                before = [metric(s, "vllm:request_success_total") for s, _ in engines]
                try:
                    res = asyncio.run(run_policy(router.url, urls[0] + "/tokenize", str(model), policy, args, view,
                                                 urls))
                finally:
                    router.stop()
                res["split"] = [int(metric(s, "vllm:request_success_total") - b) for (s, _), b in zip(engines, before)]
                results[policy] = res
                print(f"{policy}: done in {res['wall_s']:.1f}s", file=sys.stderr)
        finally:
            view.close()
            for s, _ in engines:
                s.stop()
    print(f"\n{args.engines} engines, {args.conversations} conversations x {args.turns} turns, model "
          f"{args.model or 'tiny Qwen3'}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'policy':<18} {'hit':>6} {'ideal':>6} {'of ideal':>9} {'held':>6} {'moved':>6} {'req/s':>7} {'tok/s':>7} "
          f"{'wall s':>7}  split")
    for policy, r in results.items():
        print(f"{policy:<18} {r['hit']:>6.1%} {r['ideal']:>6.1%} {r['of_ideal']:>9.1%} {r['held_of_ideal']:>6.1%} "
              f"{r['moved_of_ideal']:>6.1%} {r['req_s']:>7.2f} {r['completion_tok_s']:>7.1f} {r['wall_s']:>7.1f}  "
              f"{r['split']}")
    if view.unanchored:
        print(f"{view.unanchored} BlockStored event(s) named a parent block never announced")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "unanchored_events": view.unanchored}, indent=1))


if __name__ == "__main__":
    main()
