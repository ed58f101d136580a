"""Load limits at the gateway's door: the body-size limit (413 before anything is parsed), admission
(vLLM's --max-num-queued-reqs: 503 with Retry-After beyond the bound), and draining on SIGTERM (503 for
new generation requests while running ones finish).

Why here and not in the scheduler: vLLM enforces max_num_queued_reqs in its API server too. The gateway
knows every engine sequence it has in flight (waiting or running) before it tokenises anything into the
engine, it can answer 503 without a round trip, and a request refused here never costs the scheduler or
the bus anything. The count is exact: a request reserves its n x prompts sequences when it is admitted
and this middleware releases them when the request's response is over, however it ends.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, envelope
from gateway.memory import HeapTrimmer
from gateway.responses import JSONResponse

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate",
                    "/skyrl/v1/generate")
RETRY_AFTER_S = 1
OVERLOADED_MESSAGE = ("The engine is currently busy and cannot accept new requests. Please try again later or "
                      "on a different instance.")  # vLLM's QueueOverflowError
BACKLOG_MESSAGE = ("The engine has reached its prefill token backlog limit. Please try again later or on a "
                   "different instance.")  # vLLM's MaxQueuedTokensError
DRAINING_MESSAGE = "The server is shutting down and accepts no new requests. Please retry on another instance."
_ADMITTED, _QUEUED = "rollbus.admitted", "rollbus.queued_tokens"


TOO_LARGE = "Content Too Large"  # RFC 9110's phrase for 413 (fixed: Python's HTTPStatus phrase varies by version)


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(envelope(f"The request body is larger than the server's limit of {limit} bytes "
                                 f"(--max-request-body-bytes)", TOO_LARGE, 413), status_code=413)


def unavailable(message: str) -> JSONResponse:
    """vLLM's 503 envelope (type "Service Unavailable", as its GracefulHTTPError) plus Retry-After."""
    return JSONResponse(envelope(message, HTTPStatus.SERVICE_UNAVAILABLE.phrase, 503), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


class Overloaded(APIError):
    """vLLM's QueueOverflowError: 503, type "Service Unavailable"; rollbus adds Retry-After."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message, status=503, type=HTTPStatus.SERVICE_UNAVAILABLE.phrase)
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}
        self.reason = reason  # the vllm:admission_rejections label; None while draining


class Admission:
    """Engine sequences in flight, against --max-num-queued-reqs; prompt tokens still waiting for their
    prefill, against --max-num-queued-tokens; HTTP generation requests in flight, for draining."""

    def __init__(self, max_sequences: int, max_queued_tokens: int | None = None):
        self.max_sequences, self.max_queued_tokens = max_sequences, max_queued_tokens
        self.sequences = 0
        self.queued_tokens = 0
        self.requests = 0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def admit(self, scope: Scope, n: int, prompt_tokens: int = 0) -> None:
        """Reserve n sequences and their prompt tokens (all n prompts) for this request, or raise Overloaded
        (503), with vLLM's rules: sequences may not go past the limit; tokens are refused once the backlog
        has reached its limit. The middleware releases what is left when the request is over."""
        if self.draining:
            raise Overloaded(DRAINING_MESSAGE)
        if self.sequences + n > self.max_sequences:
            raise Overloaded(OVERLOADED_MESSAGE, "max_num_queued_reqs")
        if self.max_queued_tokens is not None and self.queued_tokens >= self.max_queued_tokens:
            raise Overloaded(BACKLOG_MESSAGE, "max_num_queued_tokens")
        self.sequences += n
        self.queued_tokens += prompt_tokens
        state = scope.setdefault("state", {})
        state[_ADMITTED] = state.get(_ADMITTED, 0) + n
        state[_QUEUED] = state.get(_QUEUED, 0) + prompt_tokens

    def prefilled(self, scope: Scope, tokens: int) -> None:
        """One engine request of this HTTP request produced its first output: its prompt is no longer
        in the prefill backlog (vLLM counts a prompt until the same moment)."""
        state = scope.get("state", {})
        k = min(tokens, state.get(_QUEUED, 0))
        state[_QUEUED] = state.get(_QUEUED, 0) - k
        self.queued_tokens -= k

    def detach(self) -> Scope:
        """A request's bookkeeping for work that outlives its HTTP request (a background response): it counts
        as a request in flight (draining waits for it) until `release`."""
        self._enter()
        return {"type": "detached", "state": {}}

    def release(self, scope: Scope) -> None:
        """The end of a detached request (a second call changes nothing)."""
        if scope.pop("type", None) == "detached":
            self._leave(scope, counted=True)

    def _enter(self) -> None:
        self.requests += 1
        self.idle.clear()

    def _leave(self, scope: Scope, counted: bool) -> None:
        state = scope.get("state", {})
        self.sequences -= state.pop(_ADMITTED, 0)
        self.queued_tokens -= state.pop(_QUEUED, 0)
        if counted:
            self.requests -= 1
            if self.requests == 0:
                self.idle.set()


class LoadLimitMiddleware:
    """Body size on every request; admission bookkeeping and draining on the generation routes."""

    def __init__(self, app: ASGIApp, admission: Admission, max_body_bytes: int, trimmer: HeapTrimmer | None = None):
        """`trimmer`: told when requests start and end, to give the heap back after a peak."""
        self.app, self.admission, self.max_body, self.trimmer = app, admission, max_body_bytes, trimmer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            await too_large(self.max_body)(scope, receive, send)  # refused before a byte is read
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        generation = path in GENERATION_PATHS
        if generation and self.admission.draining:
            await unavailable(DRAINING_MESSAGE)(scope, receive, send)
            return
        if generation:
            self.admission._enter()
            if self.trimmer is not None:
                self.trimmer.started()
        seen = [0]
        try:
            await self.app(scope, self._limited(receive, seen), send)
        finally:  # whatever route admitted sequences, they are released here
            self.admission._leave(scope, counted=generation)
            if self.trimmer is not None:
                self.trimmer.ended(seen[0])

    def _limited(self, receive: Receive, seen: list[int]) -> Receive:
        """A chunked body (no Content-Length) is counted (into seen[0]) as it arrives; past the limit,
        BodyTooLarge (413)."""
        limit = self.max_body

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise BodyTooLarge()
            return message

        return wrapped
