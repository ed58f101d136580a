"""POST /v1/completions: validate, fan out prompts x n engine requests, shape vLLM's responses.

Choices are indexed prompt_index * n + i (OpenAI batch semantics); the i-th sample of a prompt with a
seed gets seed + i, like vLLM's child requests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.choice_runner import collect, run_choices
from gateway.choice_state import ChoiceState, ChoiceUpdate, routed_experts_b64
from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import bad_request
from gateway.protocol.completions import CompletionRequest
from gateway.response_parts import clamp_logprob, usage
from gateway.responses import JSONResponse
from gateway.serving import ServingContext, child_seed, request_base_id, truncate_prompt
from gateway.sse import SSEResponse, sse_stream

YIELD_EVERY = 256  # prompts prepared between two yields to the event loop
Step = tuple[float, list[list[float]]] | None  # one position: (logprob, [[alt id, alt logprob], ...]) or None


def completion_logprobs(ctx: ServingContext, token_ids: list[int], logprobs: list[float] | None,
                        top: list[list[list[float]]] | None, text_offset: int,
                        as_ids: bool = False) -> dict[str, Any] | None:
    """vLLM/OpenAI completions logprobs of generated tokens (see `logprobs_of_steps`)."""
    if logprobs is None:
        return None
    steps: list[Step] = [(logprobs[k], top[k] if top and k < len(top) else []) for k in range(len(token_ids))]
    return logprobs_of_steps(ctx, token_ids, steps, text_offset, as_ids, -1)


def logprobs_of_steps(ctx: ServingContext, token_ids: list[int], steps: list[Step], text_offset: int,
                      as_ids: bool, num_top: int) -> dict[str, Any]:
    """vLLM's `_create_completion_logprobs`: parallel lists tokens, token_logprobs, top_logprobs (a dict
    per position: the token itself first, then its top alternatives, at most num_top + 1 entries unless
    num_top is -1) and text_offset (each offset = the previous one + the length of the previous token's
    label). A position without logprobs (the first prompt token under echo) has null entries."""

    def label(t: int) -> str:
        return f"token_id:{t}" if as_ids else ctx.token_str(t)

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = text_offset
    for tid, step in zip(token_ids, steps):
        s = label(tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if step is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        lp = clamp_logprob(step[0])
        token_logprobs.append(lp)
        alts: dict[str, float] = {s: lp}
        for alt_id, alt_lp in step[1]:
            if num_top != -1 and len(alts) > num_top:
                break
            alts.setdefault(label(int(alt_id)), clamp_logprob(alt_lp))
        top_logprobs.append(alts)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def prompt_steps(state: ChoiceState) -> list[Step]:
    """Logprob steps of the prompt positions (None first) from the engine's prompt logprobs."""
    plp = state.prompt_logprobs
    n = len(state.prompt_ids)
    if plp is None:
        return [None] * n
    tops = [[[int(a), float(b)] for a, b in zip(ids, lps)] for ids, lps in zip(plp.topk_ids.tolist(),
                                                                              plp.topk_logprobs.tolist())]
    return [None, *((float(lp), t) for lp, t in zip(plp.logprobs.tolist(), tops))]


def choice_logprobs(ctx: ServingContext, body: CompletionRequest, state: ChoiceState, token_ids: list[int],
                    logprobs: list[float] | None, top: list[list[list[float]]] | None, text_offset: int,
                    with_prompt: bool) -> dict[str, Any] | None:
    """The choice's `logprobs`: output tokens, preceded by the prompt's under echo (vLLM)."""
    if body.logprobs is None:
        return None
    steps: list[Step] = [] if body.echo_only else [
        (logprobs[k] if logprobs else 0.0, top[k] if top and k < len(top) else []) for k in range(len(token_ids))]
    ids = [] if body.echo_only else list(token_ids)
    if with_prompt:
        steps, ids = prompt_steps(state) + steps, state.prompt_ids + ids
    return logprobs_of_steps(ctx, ids, steps, text_offset, ctx.tokens_as_ids(body.return_tokens_as_token_ids),
                             body.logprobs)


async def prepare(ctx: ServingContext, body: CompletionRequest, request_id: str) -> tuple[list[list[int]],
                                                                                          list[ChoiceState]]:
    """Tokenize and validate every prompt; one ChoiceState per engine request. Raises APIError."""
    body.check()
    prompts = body.prompts()
    ctx.check_prompt_count(len(prompts), "prompt")
    id_tokens = sum(len(p) for p in prompts if not isinstance(p, str))
    ctx.check_prompt_tokens(id_tokens, "prompt")  # before any copy
    texts = [p for p in prompts if isinstance(p, str)]
    if ctx.tokenizer is None:
        check_tokens_only(body, bool(texts), ctx.tokens_as_ids(body.return_tokens_as_token_ids))
    budget = ctx.cfg.gateway.max_prompt_tokens_per_request - id_tokens  # tokenising stops once the texts exceed it
    tokenized = iter(await ctx.encode_many(texts, body.add_special_tokens, budget=budget,
                                           keep=body.truncate_prompt_tokens) if texts else [])
    encoded: list[list[int]] = []
    for pi, p in enumerate(prompts):
        if pi % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)  # thousands of prompts: let the other requests' streams run between slices
        ids = truncate_prompt(list(p) if isinstance(p, list) else next(tokenized), body.truncate_prompt_tokens,
                              body.truncation_side)
        ctx.check_prompt(ids, "prompt")
        encoded.append(ids)
    ctx.check_prompt_tokens(sum(map(len, encoded)), "prompt")
    states: list[ChoiceState] = []
    for pi, ids in enumerate(encoded):
        if pi % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)  # ~75 us a prompt: 4,096 of them would hold the loop for 0.3 s
        default = ctx.max_tokens_for(len(ids), body.max_tokens, "max_tokens", "prompt")
        params = body.to_sampling_params(default, ctx.model.sampling_defaults)
        params = ctx.with_lora(params, body.model)
        params = ctx.validate_params(params, len(ids))
        echo = ""
        if body.echo and not body.return_token_ids:  # vLLM: with return_token_ids the echoed text is ""
            p = prompts[pi]
            echo = p if isinstance(p, str) and not body.truncate_prompt_tokens else ctx.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens)
        for i in range(params.n):
            child = params.replace(n=1, seed=child_seed(params.seed, i))
            idx = pi * params.n + i
            states.append(ChoiceState(idx, f"{request_id}-{idx}", ids, child, ctx.detokenizer(ids, child),
                                      prefix=echo, hide_output=body.echo_only))
    return encoded, states


def check_tokens_only(body: CompletionRequest, has_text: bool, tokens_as_ids: bool) -> None:
    """--tokens-only loads no tokenizer: text in or text out cannot be served (vLLM refuses them too)."""
    why = "this server runs with --tokens-only and loads no tokenizer"
    if has_text:
        raise bad_request(f"{why}: send the prompt as token ids (or use POST /inference/v1/generate)", "prompt")
    if body.stop_list():
        raise bad_request(f"stop strings are not supported: {why}; use stop_token_ids", "stop")
    if body.echo and not body.return_token_ids:
        raise bad_request(f"echo needs the prompt text: {why}; set return_token_ids", "echo")
    if body.logprobs is not None and not tokens_as_ids:
        raise bad_request(f"logprob tokens need a tokenizer: {why}; set return_tokens_as_token_ids",
                          "return_tokens_as_token_ids")


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    model_name = ctx.check_ready(body.model)
    request_id = "cmpl-" + request_base_id(request, body.request_id, lambda: uuid.uuid4().hex)
    encoded, states = await prepare(ctx, body, request_id)
    ctx.admit(request, states)
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
            "logprobs": choice_logprobs(ctx, body, s, s.token_ids, s.logprobs, s.top_logprobs, 0, bool(body.echo)),
            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
            "prompt_logprobs": ctx.prompt_logprobs_json(s.prompt_ids, s.prompt_logprobs),
            "routed_experts": routed_experts_b64(s)}
        if body.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = s.prompt_ids, s.token_ids
        if body.return_weight_versions:
            choice["weight_versions"] = s.weight_versions(ctx.client.control_state)
        if body.return_sampling_mass:
            choice["sampling_mass"] = s.sampling_mass
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
    echo_now = bool(body.echo) and first  # vLLM: the echoed prompt goes with the first chunk
    choice: dict[str, Any] = {
        "index": upd.index, "text": upd.text,
        "logprobs": choice_logprobs(ctx, body, state, upd.token_ids, upd.logprobs, upd.top_logprobs,
                                    upd.text_offset, echo_now),
        "finish_reason": upd.finish_reason, "stop_reason": upd.stop_reason}
    if body.return_token_ids:
        choice["token_ids"] = upd.token_ids
        if first:
            choice["prompt_token_ids"] = state.prompt_ids
    if upd.finish_reason is not None:  # the last chunk of the choice only
        if body.return_weight_versions:
            choice["weight_versions"] = state.weight_versions(ctx.client.control_state)
        choice["routed_experts"] = routed_experts_b64(state)
    if body.return_sampling_mass:
        choice["sampling_mass"] = upd.sampling_mass or []
    chunk = {**head, "choices": [choice]}
    if body.continuous_usage():
        chunk["usage"] = usage(len(state.prompt_ids), len(state.token_ids))
    return chunk
