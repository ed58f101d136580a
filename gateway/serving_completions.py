"""POST /v1/completions: validate, fan out prompts x n engine requests, shape vLLM's responses.

Choices are indexed prompt_index * n + i (OpenAI batch semantics); the i-th sample of a prompt with a
seed gets seed + i, like vLLM's child requests.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.protocol import CompletionRequest
from gateway.serving import (
    ChoiceState,
    ChoiceUpdate,
    ClientDisconnected,
    ServingContext,
    SSEResponse,
    child_seed,
    clamp_logprob,
    collect,
    request_base_id,
    run_choices,
    sse_stream,
    truncate_prompt,
    until_disconnected,
    usage,
)


def completion_logprobs(ctx: ServingContext, token_ids: list[int], logprobs: list[float] | None,
                        top: list[list[list[float]]] | None, text_offset: int,
                        as_ids: bool = False) -> dict[str, Any] | None:
    """vLLM/OpenAI completions logprobs: tokens, token_logprobs, top_logprobs (token -> logprob,
    always including the sampled token) and text_offset (character offsets into the choice's text)."""
    if logprobs is None:
        return None

    def label(t: int) -> str:
        return f"token_id:{t}" if as_ids else ctx.token_str(t)

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    pos = text_offset
    for k, tid in enumerate(token_ids):
        s, lp = label(tid), clamp_logprob(logprobs[k])
        tokens.append(s)
        token_logprobs.append(lp)
        alts: dict[str, float] = {}
        for alt_id, alt_lp in (top[k] if top and k < len(top) else []):
            alts.setdefault(label(int(alt_id)), clamp_logprob(alt_lp))
        alts.setdefault(s, lp)
        top_logprobs.append(alts)
        offsets.append(pos)
        pos += len(ctx.token_str(tid))
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


async def prepare(ctx: ServingContext, body: CompletionRequest, request_id: str) -> tuple[list[list[int]],
                                                                                          list[ChoiceState]]:
    """Tokenize and validate every prompt; one ChoiceState per engine request. Raises APIError."""
    body.check()
    prompts = body.prompts()
    texts = [p for p in prompts if isinstance(p, str)]
    tokenized = iter(await ctx.encode_many(texts, body.add_special_tokens) if texts else [])
    encoded: list[list[int]] = []
    for p in prompts:
        ids = truncate_prompt(list(p) if isinstance(p, list) else next(tokenized), body.truncate_prompt_tokens)
        ctx.check_prompt(ids, "prompt")
        encoded.append(ids)
    states: list[ChoiceState] = []
    for pi, ids in enumerate(encoded):
        default = ctx.max_tokens_for(len(ids), body.max_tokens, "max_tokens", "prompt")
        params = body.to_sampling_params(default, ctx.model.sampling_defaults)
        ctx.validate_params(params)
        echo = ""
        if body.echo:
            p = prompts[pi]
            echo = p if isinstance(p, str) and not body.truncate_prompt_tokens else ctx.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens)
        for i in range(params.n):
            child = dataclasses.replace(params, n=1, seed=child_seed(params.seed, i))
            idx = pi * params.n + i
            detok = ctx.tokenizer.new_detokenizer(ids, skip_special_tokens=child.skip_special_tokens)
            states.append(ChoiceState(idx, f"{request_id}-{idx}", ids, child, detok, prefix=echo))
    return encoded, states


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    model_name = ctx.check_ready(body.model)
    request_id = "cmpl-" + request_base_id(request, body.request_id, lambda: uuid.uuid4().hex)
    encoded, states = await prepare(ctx, body, request_id)
    created = int(time.time())
    head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
    if body.stream:
        return SSEResponse(sse_stream(_chunks(ctx, body, head, encoded, states)))
    try:
        await until_disconnected(request.receive, collect(ctx, states))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, head, encoded, states))


def _response(ctx: ServingContext, body: CompletionRequest, head: dict[str, Any], encoded: list[list[int]],
              states: list[ChoiceState]) -> dict[str, Any]:
    choices = []
    for s in states:
        choice: dict[str, Any] = {
            "index": s.index, "text": s.text,
            "logprobs": completion_logprobs(ctx, s.token_ids, s.logprobs if s.params.logprobs is not None
                                            else None, s.top_logprobs, 0, bool(body.return_tokens_as_token_ids)),
            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason, "prompt_logprobs": None}
        if body.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = s.prompt_ids, s.token_ids
        if body.return_weight_versions:
            choice["weight_versions"] = s.weight_versions(ctx.client.control_state)
        choices.append(choice)
    n = max(1, len(states) // max(1, len(encoded)))
    cached = sum(states[pi * n].num_cached_tokens for pi in range(len(encoded)))
    u = usage(sum(map(len, encoded)), sum(len(s.token_ids) for s in states), cached)
    return {**head, "choices": choices, "usage": u, "system_fingerprint": None}


async def _chunks(ctx: ServingContext, body: CompletionRequest, head: dict[str, Any], encoded: list[list[int]],
                  states: list[ChoiceState]) -> AsyncIterator[dict[str, Any]]:
    by_index = {s.index: s for s in states}
    started: set[int] = set()
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for upd in updates:
            if not (upd.text or upd.token_ids or upd.finish_reason):
                continue
            yield _chunk(ctx, body, head, upd, by_index[upd.index], upd.index not in started)
            started.add(upd.index)
    if body.include_usage():
        n = max(1, len(states) // max(1, len(encoded)))
        cached = sum(states[pi * n].num_cached_tokens for pi in range(len(encoded)))
        yield {**head, "choices": [], "usage": usage(sum(map(len, encoded)),
                                                      sum(len(s.token_ids) for s in states), cached)}


def _chunk(ctx: ServingContext, body: CompletionRequest, head: dict[str, Any], upd: ChoiceUpdate,
           state: ChoiceState, first: bool) -> dict[str, Any]:
    logprobs = upd.logprobs if state.params.logprobs is not None else None
    choice: dict[str, Any] = {
        "index": upd.index, "text": upd.text,
        "logprobs": completion_logprobs(ctx, upd.token_ids, logprobs, upd.top_logprobs, upd.text_offset,
                                        bool(body.return_tokens_as_token_ids)),
        "finish_reason": upd.finish_reason, "stop_reason": upd.stop_reason}
    if body.return_token_ids:
        choice["token_ids"] = upd.token_ids
        if first:
            choice["prompt_token_ids"] = state.prompt_ids
    if body.return_weight_versions and upd.finish_reason is not None:  # the last chunk only
        choice["weight_versions"] = state.weight_versions(ctx.client.control_state)
    chunk = {**head, "choices": [choice]}
    if body.continuous_usage():
        chunk["usage"] = usage(len(state.prompt_ids), len(state.token_ids))
    return chunk
