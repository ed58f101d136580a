"""The OpenAI Responses API, as vLLM 0.33 serves it: POST /v1/responses (JSON, SSE events, or in the
background), GET /v1/responses/{id} (the stored response, or with ?stream=true a background stream's events
again, from ?starting_after), POST /v1/responses/{id}/cancel (a background response).

A response runs as the chat request it becomes (gateway/responses_protocol.py): the chat template, the tool
and reasoning parsers, forced tool calls and structured outputs are the chat endpoint's
(gateway/serving_chat.py). Its deltas become events and output items in gateway/responses_events.py; JSON
and streamed responses take the same path, so both hold the same items. Stored responses live in the
gateway's memory, bounded (gateway/responses_store.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import Response

from bus.sampling_params import ParamError
from gateway.choice_runner import run_choices
from gateway.choice_state import ChoiceState
from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import APIError, api_error_from, bad_request
from gateway.responses import JSONResponse, dumps
from gateway.responses_events import OutputStream
from gateway.responses_protocol import ResponsesRequest, responses_param
from gateway.responses_store import LIMIT_FLAG, ResponseStore, StoredResponse
from gateway.serving import ServingContext
from gateway.serving_chat import ChatChoice, chat_logprobs, choice_delta, prepare
from gateway.sse import SSEResponse

log = structlog.get_logger()
Shell = Callable[..., dict[str, Any]]  # status, output, usage -> the response object


def sse_event(event: dict[str, Any]) -> bytes:
    """vLLM's framing of a Responses event: `event: <type>` then its JSON (no [DONE] at the end)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


async def create_response(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest,
                          request: Request) -> Response:
    model_name = ctx.check_ready(body.model)
    stored = _stored(store, body)
    response_id = body.request_id or f"resp_{uuid.uuid4().hex}"
    try:
        body.check()
        parent = store.previous(body.previous_response_id) if body.previous_response_id else None
        turn = body.input_messages()
        chat = body.to_chat((parent.history() if parent else []) + turn, ctx.model.max_model_len)
        (state,) = await prepare(ctx, chat, response_id)
    except ParamError as e:
        raise ParamError(responses_param(e.param) or "input", str(e)) from None
    except APIError as e:
        e.param = responses_param(e.param)
        raise
    if body.max_output_tokens is not None:  # vLLM: at most the rest of the context, never a 400
        state.params = state.params.replace(max_tokens=min(body.max_output_tokens, state.params.max_tokens or 1))
    shell = functools.partial(_response_object, body, response_id, int(time.time()), model_name, state)
    entry = None
    if stored:
        entry = StoredResponse(shell("queued" if body.background else "in_progress"), turn, parent,
                               background=bool(body.background), events=[] if body.background and body.stream else None)
        store.put(entry)
    try:
        if body.background:
            scope = ctx.admission.detach()
            ctx.admit(_Scoped(scope), [state])
        else:
            ctx.admit(request, [state])
    except Exception:
        if entry is not None:
            store.discard(entry)
        if body.background:
            ctx.admission.release(scope)
        raise
    events = _events(ctx, body, shell, state, entry)
    if body.background:
        assert entry is not None
        entry.task = asyncio.create_task(_background(events, entry), name=f"responses-{response_id}")
        entry.task.add_done_callback(functools.partial(_ended, ctx, entry, scope))
        if body.stream:
            return SSEResponse(replay(entry, None))
        return JSONResponse(entry.response)
    if body.stream:
        return SSEResponse(_stream(events, entry, store))
    try:
        final = await until_disconnected(request.receive, _final(events))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if entry is not None and entry.running:
            store.discard(entry)  # as vLLM, a response is stored once it has finished
    return JSONResponse(final)


def _stored(store: ResponseStore, body: ResponsesRequest) -> bool:
    """Whether this response is stored: `store` (default true) on a server that stores responses."""
    if body.store is False:
        return False
    if store.limit == 0:
        if "store" in body.model_fields_set or body.background:
            param = "store" if "store" in body.model_fields_set else "background"
            raise bad_request(f"This server stores no responses ({LIMIT_FLAG} 0): send store=false, without "
                              "background", param)
        return False
    return True


class _Scoped:
    """What ctx.admit needs of a request (its ASGI scope), for a background response that outlives it."""

    def __init__(self, scope: dict[str, Any]):
        self.scope = scope


def _response_object(body: ResponsesRequest, response_id: str, created: int, model: str, state: ChoiceState,
                     status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                     error: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ResponsesResponse (plus OpenAI's `error`): the request's settings and the effective sampling."""
    params = state.params
    return {
        "id": response_id, "created_at": created, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "metadata": body.metadata, "model": model, "object": "response",
        "output": output or [], "parallel_tool_calls": body.parallel_tool_calls, "temperature": params.temperature,
        "tool_choice": body.tool_choice, "tools": body.tools, "top_p": params.top_p,
        "background": bool(body.background),
        "max_output_tokens": params.max_tokens, "max_tool_calls": None,
        "previous_response_id": body.previous_response_id, "prompt": None,
        "reasoning": body.reasoning.model_dump() if body.reasoning else None, "service_tier": body.service_tier,
        "status": status, "text": body.text.model_dump(by_alias=True) if body.text else None,
        "top_logprobs": params.logprobs, "truncation": body.truncation, "usage": usage, "user": body.user,
        "input_messages": None, "output_messages": None}


def _usage(state: ChoiceState) -> dict[str, Any]:
    """vLLM's ResponseUsage (one turn: rollbus runs no built-in tools)."""
    prompt, output, cached = len(state.prompt_ids), len(state.token_ids), state.num_cached_tokens
    parser = state.parser if isinstance(state, ChatChoice) else None
    reasoning = parser.reasoning_tokens(state.token_ids) if parser is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "input_tokens_per_turn": [prompt],
                                                             "cached_tokens_per_turn": [cached]},
            "output_tokens": output, "output_tokens_details": {
                "reasoning_tokens": reasoning, "tool_output_tokens": 0, "output_tokens_per_turn": [output],
                "tool_output_tokens_per_turn": [0]},
            "total_tokens": prompt + output}


async def _events(ctx: ServingContext, body: ResponsesRequest, shell: Shell, state: ChoiceState,
                  entry: StoredResponse | None) -> AsyncIterator[dict[str, Any]]:
    """Every event of one response, created to completed; the final response is stored (when it is)
    before its response.completed event is sent. An engine failure raises (APIError)."""
    seq = itertools.count()
    top_n, as_ids = body.top_logprobs or 0, ctx.tokens_as_ids(None)
    yield {"type": "response.created", "sequence_number": next(seq), "response": shell("in_progress")}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": shell("in_progress")}
    out = OutputStream()
    async with aclosing(run_choices(ctx, [state])) as updates:  # type: ignore[type-var]
        async for upd in updates:
            if not (upd.text or upd.token_ids or upd.finish_reason):
                continue
            delta, _ = choice_delta(upd, state)
            lps = chat_logprobs(ctx, upd.token_ids, upd.logprobs, upd.top_logprobs, top_n, as_ids)
            for event in out.push(delta, lps["content"] if lps else None):
                yield {**event, "sequence_number": next(seq)}
    for event in out.close():
        yield {**event, "sequence_number": next(seq)}
    status = {"length": "incomplete", "abort": "cancelled"}.get(state.finish_reason or "", "completed")
    final = shell(status, out.items, _usage(state))
    if entry is not None:
        entry.finish(final)
    yield {"type": "response.completed", "sequence_number": next(seq), "response": final}


async def _final(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    async with aclosing(events) as it:  # type: ignore[type-var]
        async for event in it:
            if event["type"] == "response.completed":
                return event["response"]
    raise APIError("the response ended without completing", status=500)


def _error_event(e: BaseException, seq: int) -> dict[str, Any]:
    """OpenAI's stream `error` event (vLLM sends its GenerationError as one)."""
    err = api_error_from(e)
    if err.status >= 500 and not isinstance(e, APIError):
        log.error("gateway.responses_failed", exc_info=e)
    return {"type": "error", "sequence_number": seq, "code": str(err.status), "message": err.message,
            "param": err.param}


async def _stream(events: AsyncIterator[dict[str, Any]], entry: StoredResponse | None,
                  store: ResponseStore) -> AsyncIterator[bytes]:
    seq = 0
    try:
        async with aclosing(events) as it:  # type: ignore[type-var]
            async for event in it:
                seq = event["sequence_number"] + 1
                yield sse_event(event)
    except Exception as e:
        yield sse_event(_error_event(e, seq))
    finally:
        if entry is not None and entry.running:
            store.discard(entry)  # the client went away, or it failed: nothing finished to store


async def _background(events: AsyncIterator[dict[str, Any]], entry: StoredResponse) -> None:
    """Run a background response to its end (or its cancel), keeping its events when it streams."""
    seq = 0
    try:
        if entry.response["status"] == "queued":
            entry.response = {**entry.response, "status": "in_progress"}
        async with aclosing(events) as it:  # type: ignore[type-var]
            async for event in it:
                seq = event["sequence_number"] + 1
                entry.add_event(sse_event(event))
    except asyncio.CancelledError:
        pass  # cancel_response marked it cancelled
    except Exception as e:  # noqa: BLE001 - the failure is the response's outcome
        error = _error_event(e, seq)
        entry.add_event(sse_event(error))
        entry.finish({**entry.response, "status": "failed", "error": {"code": error["code"],
                                                                       "message": error["message"]}})


def _ended(ctx: ServingContext, entry: StoredResponse, scope: dict[str, Any], _: asyncio.Task) -> None:
    """A background response's task is over (also when it was cancelled before it ran)."""
    ctx.admission.release(scope)
    entry.task = None
    entry.changed.set()


async def replay(entry: StoredResponse, starting_after: int | None) -> AsyncIterator[bytes]:
    """A background stream's events after `starting_after` (a sequence number), then the live ones until
    the response has finished."""
    i = 0 if starting_after is None else starting_after + 1
    while True:
        events = entry.events or []
        while i < len(events):
            yield events[i]
            i += 1
        if entry.task is None:  # its run is over and every event is in
            return
        entry.changed.clear()
        if i < len(entry.events or []) or entry.task is None:
            continue
        await entry.changed.wait()


async def retrieve_response(store: ResponseStore, response_id: str, stream: bool | None,
                            starting_after: int | None) -> Response:
    entry = store.get(response_id)
    if not stream:
        return JSONResponse(entry.response)
    if entry.events is None:
        raise bad_request(f"Response with id '{response_id}' has no events to stream: stream=true replays a response "
                          "created with background=true and stream=true", "stream")
    return SSEResponse(replay(entry, starting_after))


async def cancel_response(store: ResponseStore, response_id: str) -> Response:
    entry = store.get(response_id)
    if not entry.background:
        raise bad_request("Cannot cancel a synchronous response.", "response_id")  # vLLM's words
    if entry.running:
        entry.response = {**entry.response, "status": "cancelled"}
        task = entry.task
        if task is not None:
            task.cancel()  # aborts the engine request
            await asyncio.gather(task, return_exceptions=True)
        entry.changed.set()
    elif entry.response["status"] != "cancelled":
        raise bad_request(f"Cannot cancel a response whose status is already {entry.response['status']}.",
                          "response_id")
    return JSONResponse(entry.response)
