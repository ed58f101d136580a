"""What serialising response bodies costs on the gateway's event loop: the stdlib (`json.dumps` as
Starlette's JSONResponse called it, and as the SSE framing did) against gateway/responses.py (orjson), in
the same run, on the very bodies the serving code builds.

The bodies: a chat completion of --tokens tokens with top-k logprobs (the real tokenizer's token strings,
fed one token per engine output through ChoiceState, shaped by serving_chat), as one JSON response and as
the stream of SSE chunks of the same request. Each side is timed --repeats times; the best and median
are reported, and the ratio of the best times. Before timing, both sides' bytes are parsed back and
compared: the same JSON value (NaN-free bodies, so the stdlib can write them) or the bench fails.

    python bench/json_bodies.py                    # 1,024 tokens, top-5, 30 repeats
    python bench/json_bodies.py --tokens 4096 --top 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus.messages import RequestOutput  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from gateway.choice_state import ChoiceState  # noqa: E402
from gateway.metrics import Metrics  # noqa: E402
from gateway.protocol.chat import ChatCompletionRequest  # noqa: E402
from gateway.responses import JSONResponse, dumps  # noqa: E402
from gateway.serving import ModelInfo, ServingContext  # noqa: E402
from gateway.serving_chat import _chunk, _response  # noqa: E402
from gateway.sse import sse  # noqa: E402

try:
    from gateway.tokenizer import Tokenizer  # where the layout of issue 9 puts it
except ImportError:
    from engine.tokenizer import Tokenizer  # type: ignore[no-redef]


def stdlib_body(content: Any) -> bytes:
    """Starlette's JSONResponse.render before this change."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def stdlib_sse(data: dict[str, Any]) -> bytes:
    """The SSE framing before this change (json.dumps, then str.encode in SSEResponse)."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def build_bodies(tokens: int, top: int, seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tok = Tokenizer.from_dir(resolve_model(None, progress=False))
    vocab = tok.vocab_size
    info = ModelInfo(names=["bench"], root="bench", max_model_len=tokens + 64, vocab_size=vocab)
    ctx = ServingContext(EngineConfig(), None, tok, info, Metrics("bench"))  # type: ignore[arg-type]
    body = ChatCompletionRequest(model="bench", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                 top_logprobs=top, max_tokens=tokens)
    params = body.to_sampling_params(tokens, {})
    prompt = tok.encode("Write a long story about a lighthouse keeper.")
    state = ChoiceState(0, "chatcmpl-bench-0", prompt, params, ctx.detokenizer(prompt, params))
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": "bench"}
    rng = random.Random(seed)
    chunks = []
    for i in range(tokens):
        t = rng.randrange(200, vocab)  # skip the special tokens at the start of SmolLM2's vocabulary
        lp = -rng.expovariate(1.0)
        alts = [[rng.randrange(200, vocab), lp - rng.expovariate(1.0) * (j + 1)] for j in range(top)]
        last = i == tokens - 1
        out = RequestOutput(request_id=state.request_id, token_ids=[t], logprobs=[lp], top_logprobs=[alts],
                            finished=last, finish_reason="length" if last else None, stop_reason=None, error=None,
                            num_prompt_tokens=len(prompt), num_cached_tokens=0, weight_epoch=0)
        chunks.append(_chunk(ctx, body, head, state.feed(out), state))
    return _response(ctx, body, {**head, "object": "chat.completion"}, [state]), chunks


def timed(fn: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--top", type=int, default=5, help="top_logprobs")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    response, chunks = build_bodies(args.tokens, args.top, args.seed)
    # Same JSON value on both sides, and the response class writes exactly `dumps`.
    old_body, new_body = stdlib_body(response), JSONResponse(response).body
    assert new_body == dumps(response)
    assert json.loads(old_body) == json.loads(new_body), "the response bodies differ"
    old_stream, new_stream = b"".join(map(stdlib_sse, chunks)), b"".join(map(sse, chunks))
    assert [json.loads(e[6:]) for e in old_stream.split(b"\n\n") if e] == \
        [json.loads(e[6:]) for e in new_stream.split(b"\n\n") if e], "the SSE streams differ"

    cases = {
        "response": (lambda: stdlib_body(response), lambda: dumps(response), len(new_body)),
        "sse stream": (lambda: [stdlib_sse(c) for c in chunks], lambda: [sse(c) for c in chunks], len(new_stream)),
    }
    results: dict[str, Any] = {"tokens": args.tokens, "top_logprobs": args.top, "repeats": args.repeats}
    print(f"chat completion, {args.tokens} tokens, top-{args.top} logprobs; {args.repeats} repeats each, "
          f"sides alternating")
    for name, (old, new, size) in cases.items():
        old_t, new_t = [], []
        for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both sides alike
            old_t += timed(old, 1)
            new_t += timed(new, 1)
        ob, nb = min(old_t), min(new_t)
        row = {"bytes": size, "stdlib_best_ms": ob * 1e3, "stdlib_median_ms": statistics.median(old_t) * 1e3,
               "orjson_best_ms": nb * 1e3, "orjson_median_ms": statistics.median(new_t) * 1e3,
               "ratio_best": ob / nb}
        results[name] = row
        print(f"  {name:<10} {size / 1e3:8.0f} kB   json.dumps {row['stdlib_best_ms']:7.2f} ms "
              f"(median {row['stdlib_median_ms']:7.2f})   orjson {row['orjson_best_ms']:6.2f} ms "
              f"(median {row['orjson_median_ms']:6.2f})   {row['ratio_best']:5.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
