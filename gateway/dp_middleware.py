"""The X-data-parallel-rank header on the generation endpoints: read once per HTTP request, checked (400
in the OpenAI error shape naming the header) before the body is even parsed, and handed to the serving
code through a context variable (gateway.choice_runner.run_choices picks the engine with it)."""

from __future__ import annotations

import contextvars

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.dp_router import HEADER, RankHeaderError, parse_rank_header
from gateway.errors import bad_request, error_response
from gateway.limits import GENERATION_PATHS

# the engine the current request's header names (None: the router balances)
requested_engine: contextvars.ContextVar[int | None] = contextvars.ContextVar("requested_engine", default=None)

_HEADER = HEADER.lower().encode()


class DataParallelRankMiddleware:
    def __init__(self, app: ASGIApp, num_engines: int):
        self.app, self.num_engines = app, num_engines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").removeprefix(scope.get("root_path", "")) \
                not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope.get("headers") or [] if k == _HEADER), None)
        try:
            rank = parse_rank_header(None if raw is None else raw.decode("latin-1"), self.num_engines)
        except RankHeaderError as e:
            await error_response(bad_request(str(e), HEADER))(scope, receive, send)
            return
        token = requested_engine.set(rank)
        try:
            await self.app(scope, receive, send)
        finally:
            requested_engine.reset(token)
