"""POST /inference/v1/generate (tokens in, tokens out) and POST /inference/v1/abort_requests, in vLLM
v0.33's tokens mode: token ids in, token ids, logprobs {token_id, logprob, rank, top_logprobs}, finish
and stop reasons, weight_versions, routed_experts and prompt logprobs out; JSON or SSE.

Registered always, answering only when scale-out is on (--enable-scale-out, --tokens-only or
VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1); otherwise 403, as vLLM. Nothing here touches a tokenizer unless the
request has stop strings (which --tokens-only refuses), so a --tokens-only gateway never needs one.
See docs/tokens.md.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from bus.sampling_params import ParamError
from engine import sampling_mask
from gateway.choice_runner import collect, run_choices
from gateway.choice_state import ChoiceState, ChoiceUpdate, routed_experts_b64
from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import APIError, bad_request
from gateway.protocol.generate import GenerateRequest
from gateway.protocol.refused import REFUSED_GENERATE
from gateway.response_parts import clamp_logprob, usage
from gateway.responses import JSONResponse, loads
from gateway.serving import ServingContext, child_seed, request_base_id
from gateway.sse import SSEResponse, sse_stream

FORBIDDEN = "PermissionDeniedError"


def check_enabled(ctx: ServingContext) -> None:
    if not ctx.cfg.rl.scale_out_enabled:
        raise APIError("Scale-out endpoints are disabled. Start the server with --enable-scale-out (or "
                       "--tokens-only, or set VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1) to enable them.",
                       status=403, type=FORBIDDEN)


def tokens_logprobs(token_ids: list[int], logprobs: list[float] | None, top: list[list[list[float]]] | None,
                    ranks: list[int] | None, num_top: int | None) -> dict[str, Any] | None:
    """vLLM's `_create_tokens_logprobs`: per token {token_id, logprob, rank, top_logprobs}, where
    top_logprobs are the first max(k, 1) entries (all for -1) of {the token itself, then its top
    alternatives in rank order}; a rank of 0 is null and -inf is -9999.0."""
    if num_top is None or logprobs is None:
        return None
    content = []
    for i, tid in enumerate(token_ids):
        rank = ranks[i] if ranks and i < len(ranks) else 0
        entries: dict[int, tuple[float, int]] = {tid: (logprobs[i], rank)}
        for j, (alt, alt_lp) in enumerate(top[i] if top and i < len(top) else []):
            entries.setdefault(int(alt), (alt_lp, j + 1))
        items = list(entries.items())
        if num_top != -1:
            items = items[:max(num_top, 1)]
        content.append({"token_id": tid, "logprob": clamp_logprob(logprobs[i]), "rank": rank or None,
                        "top_logprobs": [{"token_id": a, "logprob": clamp_logprob(lp), "rank": r or None}
                                         for a, (lp, r) in items]})
    return {"content": content}


def _remap(e: ParamError) -> ParamError:
    """Engine field names live under sampling_params on this endpoint."""
    if e.param.startswith("sampling_params.") or e.param in ("token_ids", "model", "stream_options", "output_mode",
                                                             "priority", *REFUSED_GENERATE):
        return e
    return ParamError(f"sampling_params.{e.param}", str(e))


def prepare(ctx: ServingContext, body: GenerateRequest, request_id: str) -> list[ChoiceState]:
    """Validate (400 naming the field) and build one ChoiceState per sample."""
    try:
        body.check()
    except ParamError as e:
        raise _remap(e) from None
    ids = list(body.token_ids)
    ctx.check_prompt(ids, "token_ids")
    sp = body.sampling_params
    max_seqs = ctx.cfg.scheduler.max_num_seqs
    if sp.n > max_seqs:
        raise bad_request(f"sampling_params.n must be at most the server's max_num_seqs ({max_seqs}), got {sp.n}.",
                          "sampling_params.n")
    default = ctx.max_tokens_for(len(ids), sp.max_tokens, "sampling_params.max_tokens", "token_ids")
    try:
        params = sp.to_sampling_params(default).replace(cache_salt=body.cache_salt, priority=body.priority)
        params = ctx.with_lora(params, body.model)
        params = ctx.validate_params(params, len(ids))
    except ParamError as e:
        raise _remap(e) from None
    if params.stop and ctx.tokenizer is None:
        raise bad_request("stop strings are not supported on a --tokens-only server because detokenization is "
                          "disabled. Check stop strings on the client, or use stop_token_ids.", "sampling_params.stop")
    if body.stream and params.prompt_logprobs is not None:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`: the stream has no field "
                          "for them.", "sampling_params.prompt_logprobs")
    if params.trace_decode_token_ids is not None:
        params = params.for_trace_replay(len(ids), ctx.model.max_model_len)
    states = []
    for i in range(params.n):
        child = params.replace(n=1, seed=child_seed(params.seed, i))
        # Text is only needed to find stop strings; token ids are the output.
        detok = ctx.detokenizer(ids, child) if child.stop else None
        states.append(ChoiceState(i, f"{request_id}-{i}", ids, child, detok))
    return states


async def create_generate(ctx: ServingContext, body: GenerateRequest, request: Request) -> Response:
    check_enabled(ctx)
    model_name = ctx.check_ready(body.model)
    request_id = "generate-tokens-" + request_base_id(request, body.request_id, lambda: uuid.uuid4().hex)
    states = prepare(ctx, body, request_id)
    ctx.admit(request, states)
    if body.stream:
        return SSEResponse(sse_stream(_chunks(ctx, body, request_id, states)))
    created = int(time.time())
    try:
        await until_disconnected(request.receive, collect(ctx, states))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, request_id, model_name, created, states))


def _choice_logprobs(s: ChoiceState, token_ids: list[int], logprobs: list[float] | None,
                     top: list[list[list[float]]] | None, ranks: list[int] | None) -> dict[str, Any] | None:
    return tokens_logprobs(token_ids, logprobs, top, ranks, s.params.logprobs)


def _response(ctx: ServingContext, body: GenerateRequest, request_id: str, model: str, created: int,
              states: list[ChoiceState]) -> dict[str, Any]:
    choices = []
    for s in states:
        choice: dict[str, Any] = {
            "index": s.index,
            "logprobs": _choice_logprobs(s, s.token_ids, s.logprobs, s.top_logprobs, s.ranks),
            "finish_reason": s.finish_reason or "stop", "stop_reason": s.stop_reason, "token_ids": s.token_ids,
            "routed_experts": routed_experts_b64(s), "sampling_mask": _mask(ctx, s.mask_pieces),
            "weight_versions": s.weight_versions(ctx.client.control_state)}
        if s.params.return_sampling_mass:
            choice["sampling_mass"] = s.sampling_mass
        choices.append(choice)
    first = states[0]
    return {"request_id": request_id, "model": model, "created": created, "output_mode": "tokens",
            "choices": choices,
            "usage": usage(len(first.prompt_ids), sum(len(s.token_ids) for s in states), first.num_cached_tokens),
            "prompt_logprobs": ctx.prompt_logprobs_json(first.prompt_ids, first.prompt_logprobs),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": first.prompt_ids if body.return_token_ids else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None}


async def _chunks(ctx: ServingContext, body: GenerateRequest, request_id: str,
                  states: list[ChoiceState]) -> AsyncIterator[dict[str, Any]]:
    prompt_ids = states[0].prompt_ids
    send_prompt = bool(body.return_token_ids)
    by_index = {s.index: s for s in states}
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for upd in updates:
            # vLLM: every chunk with tokens, and the terminal one even without (an abort has none)
            if not (upd.token_ids or upd.finish_reason):
                continue
            chunk = _chunk(ctx, body, request_id, upd, by_index[upd.index])
            if send_prompt:  # the first chunk only
                chunk["prompt_token_ids"], send_prompt = prompt_ids, False
            yield chunk
    if body.include_usage():
        yield {"request_id": request_id, "output_mode": "tokens", "choices": [],
               "usage": usage(len(prompt_ids), sum(len(s.token_ids) for s in states), states[0].num_cached_tokens)}


def _chunk(ctx: ServingContext, body: GenerateRequest, request_id: str, upd: ChoiceUpdate,
           state: ChoiceState) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": upd.index, "finish_reason": upd.finish_reason, "stop_reason": upd.stop_reason,
        "token_ids": upd.token_ids,
        "logprobs": _choice_logprobs(state, upd.token_ids, upd.logprobs, upd.top_logprobs, upd.ranks),
        "routed_experts": routed_experts_b64(state) if upd.finish_reason else None,
        "sampling_mask": _mask(ctx, [upd.sampling_mask] if upd.sampling_mask is not None else []),
        "weight_versions": state.weight_versions(ctx.client.control_state) if upd.finish_reason else None}
    if state.params.return_sampling_mass:
        choice["sampling_mass"] = upd.sampling_mass or []
    u = usage(len(state.prompt_ids), len(state.token_ids)) if body.continuous_usage() else None
    return {"request_id": request_id, "output_mode": "tokens", "choices": [choice], "usage": u}


def _mask(ctx: ServingContext, pieces: list[tuple[Any, Any]]) -> list[list[int]] | None:
    """vLLM's `sampling_mask` (--return-sampling-mask): per generated token, the ids the sampler could draw
    (ascending); null without the flag."""
    if not ctx.cfg.rl.return_sampling_mask:
        return None
    return [row for ids, counts in pieces for row in sampling_mask.expand(ids, counts, ctx.model.vocab_size)]


async def abort_requests(ctx: ServingContext, request: Request) -> Response:
    """POST /inference/v1/abort_requests {"request_ids": [...]}: aborts those requests (the ids the server
    returned, e.g. generate-tokens-<id>) in the background; empty 200, as vLLM."""
    check_enabled(ctx)
    try:
        body = loads(await request.body())
    except ValueError:
        raise bad_request("body is not valid JSON") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise bad_request("request_ids must be a list of strings", "request_ids")
    running = list(getattr(ctx.client, "queues", {}))
    # Engine ids are "<request id>-<choice index>"; match the ids clients know.
    hit = [r for r in running if any(r == i or r.startswith(i + "-") for i in ids)]
    if hit:
        await ctx.client.abort(hit)
    return Response(status_code=200)

