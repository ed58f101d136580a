"""POST /v1/chat/completions: render the chat template, validate, run n samples, shape vLLM's responses.

Tools are rendered into the prompt by the template; with --enable-auto-tool-choice and tool_choice "auto"
the calls are parsed out of the output, and with --reasoning-parser the reasoning is split from the
content (gateway/chat_parsing.py), streaming and not. tool_choice "required" or a named function forces
the output with a grammar, and it is returned as `tool_calls` (gateway/forced_tools.py).
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
from gateway.chat_parsing import ChatOutputParser, ParserConfig
from gateway.choice_runner import collect, run_choices
from gateway.choice_state import ChoiceState, ChoiceUpdate, routed_experts_b64
from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import bad_request
from gateway.forced_tools import ForcedToolStream, finish_reason, forced_tool_calls
from gateway.protocol.chat import ChatCompletionRequest
from gateway.response_parts import clamp_logprob, usage
from gateway.responses import JSONResponse
from gateway.serving import ServingContext, child_seed, request_base_id, truncate_prompt
from gateway.sse import SSEResponse, sse_stream

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
    if body.chat_template is not None and not ctx.cfg.model.trust_request_chat_template:  # every caller: vLLM's rule
        raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                          "set. Refused request with untrusted chat template.", "chat_template")
    given = {**ctx.default_chat_template_kwargs, **body.template_kwargs()}  # vLLM: the request's win
    kwargs = {k: v for k, v in given.items() if k not in _RESERVED_TEMPLATE_KWARGS}
    messages = body.template_messages()
    tools = body.template_tools()
    if ctx.cfg.model.exclude_tools_when_tool_choice_none and body.tool_choice_value() == "none":
        tools = None
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 tools=tools, chat_template=body.chat_template, **kwargs)
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


def parser_config(ctx: ServingContext, body: ChatCompletionRequest) -> ParserConfig:
    """The output parsing of this request; vLLM's 400 for tool_choice "auto" without the server flags."""
    auto = body.tool_choice_value() == "auto" and bool(body.tools)
    if auto and not (ctx.cfg.model.enable_auto_tool_choice and ctx.cfg.model.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                          "tool_choice")
    kwargs = {**ctx.default_chat_template_kwargs, **body.template_kwargs()}
    return ParserConfig(tool_parser=ctx.cfg.model.tool_call_parser if ctx.cfg.model.enable_auto_tool_choice else None,
                        reasoning_parser=ctx.cfg.model.reasoning_parser or None, tool_choice_auto=auto,
                        parallel_tool_calls=body.parallel_tool_calls is not False,
                        include_reasoning=body.include_reasoning, chat_template_kwargs=kwargs,
                        tools=body.template_tools())


class ChatChoice(ChoiceState):
    """A chat choice: the engine request's state plus the parser of its output, or, for a forced tool
    choice, the reader of its forced tool calls."""

    parser: ChatOutputParser | None = None
    forced: ForcedToolStream | None = None


async def prepare(ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> list[ChoiceState]:
    """Render, tokenize and validate; one ChoiceState per sample. Raises APIError / ParamError."""
    try:
        body.check()
    except ParamError as e:
        raise _remap(e, body) from None
    parsing = parser_config(ctx, body)
    if body.chat_template is not None and not ctx.cfg.model.trust_request_chat_template:
        raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                          "set. Refused request with untrusted chat template.", "chat_template")
    if ctx.tokenizer is None:
        raise bad_request("this server runs with --tokens-only and loads no tokenizer, so it cannot render a "
                          "chat: render it yourself and send token ids to POST /inference/v1/generate", "messages")
    (ids,) = await ctx.encode_many([render_prompt(ctx, body)], body.add_special_tokens,
                                   budget=ctx.cfg.gateway.max_prompt_tokens_per_request,
                                   keep=body.truncate_prompt_tokens,
                                   param="messages")
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, body.truncation_side)
    ctx.check_prompt(ids, "messages")
    default = ctx.max_tokens_for(len(ids), body.requested_max_tokens(), body.max_tokens_param(), "messages")
    try:
        params = body.to_sampling_params(default, ctx.model.sampling_defaults)
        params = ctx.with_lora(params, body.model)
        params = ctx.validate_params(params, len(ids))
    except ParamError as e:
        raise _remap(e, body) from None
    states: list[ChoiceState] = []
    forced = body.forced_tool()
    for i in range(params.n):
        parser = ChatOutputParser(parsing, ctx.tokenizer, ids) if parsing.active and not forced else None
        child = params.replace(n=1, seed=child_seed(params.seed, i))
        if parser is not None:
            child = child.replace(skip_special_tokens=parser.skip_special_tokens(child.skip_special_tokens))
        state = ChatChoice(i, f"{request_id}-{i}", ids, child, ctx.detokenizer(ids, child))
        state.parser = parser
        state.forced = ForcedToolStream(body.tool_choice) if forced else None
        states.append(state)
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


def _message(s: ChoiceState) -> tuple[dict[str, Any], str | None]:
    """vLLM's assistant message of a finished choice (tool_calls only when there are some) and its
    finish_reason. `reasoning` is vLLM's field; `reasoning_content` carries the same for older clients."""
    parser = s.parser if isinstance(s, ChatChoice) else None
    forced = s.forced if isinstance(s, ChatChoice) else None
    if forced is not None:  # the output is the forced calls' JSON (gateway/forced_tools.py)
        json_calls = forced_tool_calls(forced.tool_choice, s.text)
        # cut before any call took shape: the text itself, never an empty message (gateway/forced_tools.py)
        message = {"role": "assistant", "content": None if json_calls or not s.text else s.text, "refusal": None}
        if json_calls:
            message["tool_calls"] = json_calls
        message["reasoning"] = message["reasoning_content"] = None
        return message, finish_reason(s.finish_reason, forced.tool_choice, bool(json_calls))
    if parser is None:
        reasoning, content, calls, reason = None, s.text, [], s.finish_reason
    else:
        parsed = parser.parse(s.text)
        reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
        reason = parser.finish_reason(s.finish_reason, parsed)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [c.to_json() for c in calls]
    message["reasoning"] = message["reasoning_content"] = reasoning
    return message, reason


def _usage(ctx: ServingContext, states: list[ChoiceState], prompt_len: int,
           cached: int | None = None) -> dict[str, Any]:
    """vLLM's usage; with --reasoning-parser also completion_tokens_details.reasoning_tokens."""
    out = usage(prompt_len, sum(len(s.token_ids) for s in states), cached)
    if ctx.cfg.model.reasoning_parser:
        count = sum(s.parser.reasoning_tokens(s.token_ids) for s in states if isinstance(s, ChatChoice) and s.parser)
        out["completion_tokens_details"] = {"reasoning_tokens": count}
    return out


def _hide_metadata(body: ChatCompletionRequest, s: ChoiceState) -> bool:
    """vLLM: with a reasoning parser and include_reasoning false, token ids and logprobs would show the
    hidden reasoning, so neither is returned."""
    return not body.include_reasoning and isinstance(s, ChatChoice) and s.parser is not None


def _response(ctx: ServingContext, body: ChatCompletionRequest, head: dict[str, Any],
              states: list[ChoiceState]) -> dict[str, Any]:
    choices = []
    for s in states:
        message, reason = _message(s)
        hide = _hide_metadata(body, s)
        choice: dict[str, Any] = {
            "index": s.index, "message": message,
            "logprobs": None if hide else _logprobs_of(ctx, body, s, s.token_ids, s.logprobs, s.top_logprobs),
            "finish_reason": reason, "stop_reason": s.stop_reason}
        if body.return_token_ids and not hide:
            choice["token_ids"] = s.token_ids
        if body.return_weight_versions:
            choice["weight_versions"] = s.weight_versions(ctx.client.control_state)
        if body.return_sampling_mass:
            choice["sampling_mass"] = s.sampling_mass
        choice["routed_experts"] = routed_experts_b64(s)
        choices.append(choice)
    prompt_ids = states[0].prompt_ids
    out = {**head, "choices": choices,
           "usage": _usage(ctx, states, len(prompt_ids), states[0].num_cached_tokens),
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
            first["usage"] = _usage(ctx, [], len(prompt_ids))
        yield first
    by_index = {s.index: s for s in states}
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for upd in updates:
            if not (upd.text or upd.token_ids or upd.finish_reason):
                continue
            chunk = _chunk(ctx, body, head, upd, by_index[upd.index])
            if chunk is not None:
                yield chunk
    if body.include_usage():
        yield {**head, "choices": [], "usage": _usage(ctx, states, len(prompt_ids), states[0].num_cached_tokens)}


def choice_delta(upd: ChoiceUpdate, state: ChoiceState) -> tuple[dict[str, Any] | None, str | None]:
    """The delta of one update (None: the parser has nothing to send yet) and the choice's finish_reason."""
    parser = state.parser if isinstance(state, ChatChoice) else None
    forced = state.forced if isinstance(state, ChatChoice) else None
    if forced is not None:  # the forced output streams as tool-call deltas (gateway/forced_tools.py)
        calls = forced.push(upd.text or "")
        delta: dict[str, Any] = {"tool_calls": calls} if calls else {}
        if upd.finish_reason is not None and not forced.made and forced.text:
            delta["content"] = forced.text  # cut before any call took shape: as the whole response says
        return delta, finish_reason(upd.finish_reason, forced.tool_choice, forced.made)
    if parser is None:
        return ({"content": upd.text} if upd.text else {}), upd.finish_reason
    got = parser.parse_delta(upd.text, finished=upd.finish_reason is not None)
    reason = None if upd.finish_reason is None else parser.finish_reason(upd.finish_reason)
    if got is None:
        return None, reason
    delta: dict[str, Any] = {}
    if got.reasoning is not None:
        delta["reasoning"] = delta["reasoning_content"] = got.reasoning
    if got.content is not None:
        delta["content"] = got.content
    if got.tool_calls:
        delta["tool_calls"] = [c.to_json() for c in got.tool_calls]
    return delta, reason


def _chunk(ctx: ServingContext, body: ChatCompletionRequest, head: dict[str, Any], upd: ChoiceUpdate,
           state: ChoiceState) -> dict[str, Any] | None:
    """One SSE chunk, or None when there is nothing to send (as vLLM: a parser's held-back step without
    logprobs or token ids to deliver)."""
    hide = _hide_metadata(body, state)
    delta, reason = choice_delta(upd, state)
    logprobs = None if hide else _logprobs_of(ctx, body, state, upd.token_ids, upd.logprobs, upd.top_logprobs)
    if delta is None:
        if upd.finish_reason is None and logprobs is None and (not body.return_token_ids or hide):
            return None
        delta = {}
    choice: dict[str, Any] = {"index": upd.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": reason, "stop_reason": upd.stop_reason}
    if body.return_token_ids and not hide:
        choice["token_ids"] = upd.token_ids
    if upd.finish_reason is not None:  # the last chunk of the choice only
        if body.return_weight_versions:
            choice["weight_versions"] = state.weight_versions(ctx.client.control_state)
        choice["routed_experts"] = routed_experts_b64(state)
    if body.return_sampling_mass:
        choice["sampling_mass"] = upd.sampling_mass or []
    chunk = {**head, "choices": [choice]}
    if body.continuous_usage():
        chunk["usage"] = _usage(ctx, [state], len(state.prompt_ids))
    return chunk
