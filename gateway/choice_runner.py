"""Running the engine requests of one HTTP request (its n x prompts choices) concurrently on one engine,
yielding their updates as they come; the first failure (or the client going away) aborts the rest."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import structlog

from bus.messages import ErrorInfo, ErrorKind
from gateway.choice_state import ChoiceState, ChoiceUpdate
from gateway.dp_middleware import requested_engine
from gateway.engine_client import DuplicateRequest, EngineDead
from gateway.errors import BAD_REQUEST, INTERNAL, APIError, api_error_from, bad_request, engine_unavailable
from gateway.request_log import log_request
from gateway.serving import ServingContext

log = structlog.get_logger()


class _Done:
    pass


@dataclass
class _Failed:
    error: APIError


def engine_failure(ctx: ServingContext, error: ErrorInfo | None) -> APIError:
    """The HTTP error of a request the engine ended with an error: 503 while the engine is down, the
    status the engine gave when it knew one (503 when paused between our check and the scheduler's, or
    queued during a level-2 sleep and woken without weights), else a 500 with the engine's message."""
    message = error.message if error is not None else None
    if not ctx.client.healthy:
        return engine_unavailable(ctx.client.dead_reason or message)
    if error is not None and error.status == 503:
        return engine_unavailable(error.message)
    if error is not None and error.status is not None:
        return APIError(error.message, status=error.status, type=BAD_REQUEST if error.status < 500 else INTERNAL,
                        param=error.param)
    return APIError(message or "the engine failed this request", status=500, type=INTERNAL)


async def _run_choice(ctx: ServingContext, state: ChoiceState, sink: asyncio.Queue) -> None:
    if ctx.cfg.gateway.enable_log_requests:
        log_request(state.request_id, state.prompt_ids, state.params, ctx.cfg.gateway.max_log_len)
    try:
        gen = ctx.client.generate(state.request_id, state.prompt_ids, state.params, ctx.eos_token_ids,
                                  engine=state.engine)
        async with aclosing(gen):  # leaving early closes it, which aborts the engine request
            async for out in gen:
                if state.on_first_output is not None:
                    state.on_first_output()
                    state.on_first_output = None
                update = state.feed(out)
                ctx.metrics.observe_delta(state, update)
                sink.put_nowait(update)
                if state.finished:
                    break
        if state.finish_reason == "error":
            raise engine_failure(ctx, state.error)
        if not state.finished:
            raise engine_failure(ctx, ErrorInfo(ErrorKind.UNFINISHED,
                                                "the engine ended the request without finishing it"))
    except asyncio.CancelledError:
        raise
    except EngineDead as e:
        sink.put_nowait(_Failed(engine_unavailable(str(e))))
    except DuplicateRequest:
        sink.put_nowait(_Failed(bad_request(f"request id {state.request_id!r} is already running", "request_id")))
    except Exception as e:
        if not isinstance(e, APIError):
            log.error("gateway.choice_failed", request_id=state.request_id, exc_info=e)
        sink.put_nowait(_Failed(api_error_from(e)))
    finally:
        ctx.metrics.observe_choice(state)
        sink.put_nowait(_Done())


async def run_choices(ctx: ServingContext, states: list[ChoiceState]) -> AsyncIterator[ChoiceUpdate]:
    """Run every choice's engine request concurrently; yield their updates as they come. The first
    failure raises (APIError) and, like a client going away, aborts the requests still running."""
    sink: asyncio.Queue = asyncio.Queue()
    try:  # one engine for all of a request's choices: they share its prefix cache
        engine = ctx.client.pick_engine(requested_engine.get(), [
            (s.request_id, len(s.prompt_ids) + (s.params.max_tokens or 0)) for s in states])
    except EngineDead as e:
        raise engine_unavailable(str(e)) from None
    for s in states:
        s.engine = engine
    tasks = [asyncio.create_task(_run_choice(ctx, s, sink)) for s in states]
    try:
        remaining = len(tasks)
        while remaining:
            item = await sink.get()
            if isinstance(item, _Done):
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.client.release([s.request_id for s in states])


async def collect(ctx: ServingContext, states: list[ChoiceState]) -> None:
    """Run every choice to the end (non-streaming responses read the states afterwards)."""
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for _ in updates:
            pass
