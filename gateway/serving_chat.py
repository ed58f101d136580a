"""POST /v1/chat/completions: render the chat template, validate, run n samples, shape vLLM's responses.

Tools are rendered into the prompt by the template. tool_choice "required" or a named function forces the
output with a grammar, and it is returned as `tool_calls` (gateway/forced_tools.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.sampling_params import ParamError
from gateway.errors import bad_request
from gateway.forced_tools import ForcedToolStream, finish_reason, forced_tool_calls
from gateway.protocol import ChatCompletionRequest
from gateway.responses import JSONResponse
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
    routed_experts_b64,
    run_choices,
    sse_stream,
    truncate_prompt,
    until_disconnected,
    usage,
)

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "chat_template"}


def chat_logprobs(ctx: ServingContext, token_ids: list[int], logprobs: list[float] | None,
                  top: list[list[list[float]]] | None, top_n: int, as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
    As vLLM: top_logprobs are the first top_n entries of {the token itself, then its top alternatives}
    (all of them for -1)."""
    if logprobs is None:
        return None

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = f"token_id:{t}" if as_ids else ctx.token_str(t)
        return {"token": s, "logprob": clamp_logprob(lp), "bytes": list(s.encode("utf-8", errors="replace"))}

    content = []
    for k, tid in enumerate(token_ids):
        alts: dict[int, float] = {tid: logprobs[k]}
        for a, lp in (top[k] if top and k < len(top) else []):
            alts.setdefault(int(a), lp)
        items = list(alts.items()) if top_n == -1 else list(alts.items())[:top_n]
        content.append({**entry(tid, logprobs[k]), "top_logprobs": [entry(a, lp) for a, lp in items]})
    return {"content": content}


def render_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> str:
    """Chat template -> prompt text (jinja holds the GIL, so a thread would not help; 20k chars ~5 ms)."""
    if body.chat_template is not None and not ctx.cfg.trust_request_chat_template:  # every caller: vLLM's rule
        raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                          "set. Refused request with untrusted chat template.", "chat_template")
    given = {**ctx.default_chat_template_kwargs, **body.template_kwargs()}  # vLLM: the request's win
    kwargs = {k: v for k, v in given.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    messages = body.template_messages()
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 tools=body.template_tools(), chat_template=body.chat_template,
                                                 **kwargs)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault (vLLM: 400)
        raise bad_request(f"Error rendering the chat template: {e}", "messages") from None
    if body.continue_final_message:
        final = messages[-1]["content"].rstrip()
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise bad_request("The final assistant message was not found in the rendered chat; cannot "
                              "continue it", "continue_final_message")
        text = text[:cut + len(final)]
    return text


def _remap(e: ParamError, body: ChatCompletionRequest) -> ParamError:
    """Name the chat field the user actually set ("top_logprobs", "max_completion_tokens")."""
    param = {"logprobs": "top_logprobs", "max_tokens": body.max_tokens_param()}.get(e.param, e.param)
    return ParamError(param, str(e))


async def prepare(ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> list[ChoiceState]:
    """Render, tokenize and validate; one ChoiceState per sample. Raises APIError / ParamError."""
    try:
        body.check()
    except ParamError as e:
        raise _remap(e, body) from None
    if body.chat_template is not None and not ctx.cfg.trust_request_chat_template:
        raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                          "set. Refused request with untrusted chat template.", "chat_template")
    if ctx.tokenizer is None:
        raise bad_request("this server runs with --tokens-only and loads no tokenizer, so it cannot render a "
                          "chat: render it yourself and send token ids to POST /inference/v1/generate", "messages")
    (ids,) = await ctx.encode_many([render_prompt(ctx, body)], body.add_special_tokens,
                                   budget=ctx.cfg.max_prompt_tokens_per_request, keep=body.truncate_prompt_tokens,
                                   param="messages")
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, body.truncation_side)
    ctx.check_prompt(ids, "messages")
    default = ctx.max_tokens_for(len(ids), body.requested_max_tokens(), body.max_tokens_param(), "messages")
    try:
        params = body.to_sampling_params(default, ctx.model.sampling_defaults)
        ctx.validate_params(params, len(ids))
    except ParamError as e:
        raise _remap(e, body) from None
    states = []
    for i in range(params.n):
        child = params.replace(n=1, seed=child_seed(params.seed, i))
        states.append(ChoiceState(i, f"{request_id}-{i}", ids, child, ctx.detokenizer(ids, child)))
    return states


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    model_name = ctx.check_ready(body.model)
    request_id = "chatcmpl-" + request_base_id(request, body.request_id, lambda: uuid.uuid4().hex)
    states = await prepare(ctx, body, request_id)
    ctx.admit(request, states)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name}
    if body.stream:
        return SSEResponse(sse_stream(_chunks(ctx, body, {**head, "object": "chat.completion.chunk"}, states)))
    try:
        await until_disconnected(request.receive, collect(ctx, states))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, head, states))


def _logprobs_of(ctx: ServingContext, body: ChatCompletionRequest, state: ChoiceState, token_ids: list[int],
                 logprobs: list[float] | None, top: list[list[list[float]]] | None) -> dict[str, Any] | None:
    if state.params.logprobs is None:
        return None
    return chat_logprobs(ctx, token_ids, logprobs, top, body.top_logprobs or 0,
                         ctx.tokens_as_ids(body.return_tokens_as_token_ids))


def _response(ctx: ServingContext, body: ChatCompletionRequest, head: dict[str, Any],
              states: list[ChoiceState]) -> dict[str, Any]:
    choices = []
    forced = body.forced_tool()
    for s in states:
        calls = forced_tool_calls(body.tool_choice, s.text) if forced else []  # gateway/forced_tools.py
        choice: dict[str, Any] = {
            "index": s.index,
            "message": {"role": "assistant", "content": None if forced else s.text, "refusal": None,
                        "tool_calls": calls, "reasoning_content": None},
            "logprobs": _logprobs_of(ctx, body, s, s.token_ids, s.logprobs, s.top_logprobs),
            "finish_reason": finish_reason(s.finish_reason, body.tool_choice, bool(calls)) if forced
            else s.finish_reason, "stop_reason": s.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = s.token_ids
        if body.return_weight_versions:
            choice["weight_versions"] = s.weight_versions(ctx.client.control_state)
        if body.return_sampling_mass:
            choice["sampling_mass"] = s.sampling_mass
        choice["routed_experts"] = routed_experts_b64(s)
        choices.append(choice)
    prompt_ids = states[0].prompt_ids
    out = {**head, "choices": choices,
           "usage": usage(len(prompt_ids), sum(len(s.token_ids) for s in states), states[0].num_cached_tokens),
           "system_fingerprint": None,
           "prompt_logprobs": ctx.prompt_logprobs_json(prompt_ids, states[0].prompt_logprobs)}
    if body.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


async def _chunks(ctx: ServingContext, body: ChatCompletionRequest, head: dict[str, Any],
                  states: list[ChoiceState]) -> AsyncIterator[dict[str, Any]]:
    prompt_ids = states[0].prompt_ids
    for s in states:  # vLLM: one role chunk per choice first
        first: dict[str, Any] = {**head, "choices": [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
        if body.return_token_ids:
            first["prompt_token_ids"] = prompt_ids
        if body.continuous_usage():
            first["usage"] = usage(len(prompt_ids), 0)
        yield first
    by_index = {s.index: s for s in states}
    forced = {s.index: ForcedToolStream(body.tool_choice) for s in states} if body.forced_tool() else None
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for upd in updates:
            if not (upd.text or upd.token_ids or upd.finish_reason):
                continue
            chunk = _chunk(ctx, body, head, upd, by_index[upd.index])
            if forced is not None:  # the forced output streams as tool-call deltas (gateway/forced_tools.py)
                f, choice = forced[upd.index], chunk["choices"][0]
                calls = f.push(upd.text or "")
                choice["delta"] = {"tool_calls": calls} if calls else {}
                choice["finish_reason"] = finish_reason(upd.finish_reason, body.tool_choice, f.made)
            yield chunk
    if body.include_usage():
        yield {**head, "choices": [], "usage": usage(len(prompt_ids), sum(len(s.token_ids) for s in states),
                                                     states[0].num_cached_tokens)}


def _chunk(ctx: ServingContext, body: ChatCompletionRequest, head: dict[str, Any], upd: ChoiceUpdate,
           state: ChoiceState) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": upd.index, "delta": {"content": upd.text} if upd.text else {},
        "logprobs": _logprobs_of(ctx, body, state, upd.token_ids, upd.logprobs, upd.top_logprobs),
        "finish_reason": upd.finish_reason, "stop_reason": upd.stop_reason}
    if body.return_token_ids:
        choice["token_ids"] = upd.token_ids
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
