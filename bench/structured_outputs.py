"""What a JSON-schema constraint costs: N concurrent chat requests with `response_format` json_schema
against the very same requests unconstrained, on one server, in one run. Rounds alternate (plain,
constrained, constrained, plain, ...) so drift on a shared machine hits both sides alike. The schema has a
long string field (minLength above what max_tokens can reach), so a constrained request runs its whole
max_tokens like the plain one (`ignore_eos`): both sides generate the same number of tokens and the
throughput ratio is the mask's cost. The bar (issue 14) is a ratio >= 0.90.

    python bench/structured_outputs.py                       # SmolLM2, 64 x 64 tokens, 2 rounds a side
    python bench/structured_outputs.py --requests 64 --max-tokens 128 --rounds 3 --json out.json

Prints, per side, the best and median useful tokens/s, then best-vs-best and median-vs-median ratios and
the load average (`os.getloadavg`), since the machine may be shared.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "body"],
          "properties": {"title": {"type": "string", "maxLength": 8},
                         "body": {"type": "string", "minLength": 4000}}}


async def _one(h: httpx.AsyncClient, i: int, max_tokens: int, constrained: bool) -> int:
    body = {"messages": [{"role": "user", "content": f"Write note number {i} as JSON."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": i, "ignore_eos": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}
    r = await h.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    if constrained:
        assert out["choices"][0]["message"]["content"].startswith('{"title"') or \
            out["choices"][0]["message"]["content"].lstrip().startswith("{"), out
    return out["usage"]["completion_tokens"]


async def _round(url: str, n: int, max_tokens: int, constrained: bool) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as h:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(_one(h, i, max_tokens, constrained) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per side")
    ap.add_argument("--json", default=None, help="write the numbers here too")
    a = ap.parse_args()
    folder = resolve_model(a.model, progress=False)
    with tempfile.TemporaryDirectory(prefix="bench-so-") as work:
        s = start_server(Path(work), str(folder), "--max-num-seqs", str(max(a.requests, 1)), "--max-model-len",
                         "1024", "--structured-outputs-config", '{"disable_any_whitespace": true}')
        try:
            # warm both paths with the measured batch (prompts in the prefix cache, the grammar compiled), so
            # the first measured round pays for neither
            asyncio.run(_round(s.url, a.requests, 4, True))
            asyncio.run(_round(s.url, a.requests, 4, False))
            sides: dict[str, list[float]] = {"plain": [], "json_schema": []}
            order = ["plain", "json_schema", "json_schema", "plain"] * a.rounds
            for side in order[:2 * a.rounds]:
                tps = asyncio.run(_round(s.url, a.requests, a.max_tokens, side == "json_schema"))
                sides[side].append(tps)
                print(f"{side:12s} {tps:8.1f} tokens/s", file=sys.stderr, flush=True)
        finally:
            s.stop()
    best = {k: max(v) for k, v in sides.items()}
    med = {k: statistics.median(v) for k, v in sides.items()}
    out = {"requests": a.requests, "max_tokens": a.max_tokens, "tokens_per_s": sides,
           "ratio_best": best["json_schema"] / best["plain"], "ratio_median": med["json_schema"] / med["plain"],
           "loadavg": os.getloadavg()}
    print(f"json_schema / plain throughput: best {out['ratio_best']:.3f}, median {out['ratio_median']:.3f} "
          f"(bar >= 0.90; load average {out['loadavg'][0]:.1f} on {os.cpu_count()} CPUs)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
