"""Streaming responses: server-sent events (text/event-stream) that stop, aborting the engine requests, as
soon as the client disconnects, and vLLM's stream error contract (an error chunk, then [DONE])."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.client_disconnect import ClientDisconnected, until_disconnected
from gateway.errors import APIError, api_error_from
from gateway.responses import dumps

log = structlog.get_logger()


class SSEResponse(StreamingResponse):
    """text/event-stream that stops producing (closing the body generator, which aborts the engine
    requests) as soon as the client disconnects, on every ASGI spec version."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.body_iterator) as body:  # type: ignore[type-var]
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, produce())
        except (ClientDisconnected, OSError):
            log.debug("gateway.client_disconnected", path=scope.get("path"))


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON chunk."""
    return b"data: " + dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE framing plus vLLM's stream error contract: an error chunk, then [DONE]."""
    try:
        async with aclosing(chunks) as it:  # type: ignore[type-var]
            async for chunk in it:
                yield sse(chunk)
    except Exception as e:
        err = api_error_from(e)
        if err.status >= 500 and not isinstance(e, APIError):
            log.error("gateway.stream_failed", exc_info=e)
        yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}})
    yield SSE_DONE
