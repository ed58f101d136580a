"""The OpenAI error envelope and the FastAPI handlers that put every failure into it.

Clients written against vLLM/OpenAI read `body["error"]["message"]`; a stack trace or FastAPI's
`{"detail": ...}` would break them. So every failure path (bad JSON, wrong types, bad sampling
parameters, unknown routes, dead engine, bugs) ends here, with vLLM's types and status codes.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bus.codec import CodecError
from bus.messages import CommandBody, ControlReply, command_name
from bus.sampling_params import ParamError
from engine.weights.lifecycle import reply_status
from gateway.responses import JSONResponse

log = structlog.get_logger()

BAD_REQUEST = "BadRequestError"
NOT_FOUND = "NotFoundError"
UNAUTHORIZED = "AuthenticationError"
INTERNAL = "InternalServerError"
UNAVAILABLE = "ServiceUnavailableError"
CONFLICT = "ConflictError"
GATEWAY_TIMEOUT = "GatewayTimeoutError"


class APIError(Exception):
    """An error the handlers raise on purpose; becomes the envelope with this status."""

    def __init__(self, message: str, *, status: int = 400, type: str = BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, status=400, type=BAD_REQUEST, param=param)


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.01, 7 * 24 * 3600.0


def check_timeout(value: object, param: str) -> float:
    """A client's timeout in seconds: a finite number from 10 ms to a week, else 400 naming `param`
    (`2e-289`, `nan`, `inf`, `1e999` and negatives are mistakes, not deadlines)."""
    import math

    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise bad_request(f"{param} must be a number of seconds from {MIN_TIMEOUT_S} to {MAX_TIMEOUT_S:.0f}, "
                          f"got {value!r}", param)
    return float(value)


def control_failure(command: CommandBody, reply: ControlReply) -> APIError:
    """A failed acked broadcast (the dev and weight-transfer routes): the status a failing member knew (a bad
    weights_path: 400, an update out of order: 409), 504 when one did not ack, else 500; the field it named."""
    status = reply_status(reply.ok, reply.missing, reply.errors)
    params = [e.param for e in reply.errors if e.param]
    kind = {409: CONFLICT, 504: GATEWAY_TIMEOUT}.get(status, BAD_REQUEST if status < 500 else INTERNAL)
    return APIError(f"{command_name(command)} failed: {reply.error}", status=status, type=kind,
                    param=params[0] if params else None)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", status=404, type=NOT_FOUND, param="model")


def engine_unavailable(reason: str | None) -> APIError:
    return APIError(reason or "the engine is not available", status=503, type=UNAVAILABLE)


def envelope(message: str, type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(envelope(err.message, err.type, err.status, err.param), status_code=err.status,
                        headers=getattr(err, "headers", None))  # Retry-After on an overload 503


def api_error_from(exc: BaseException) -> APIError:
    """Map any exception to the APIError it should be reported as (also used for stream error chunks)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ParamError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return validation_error(exc.errors())
    return APIError(f"{type(exc).__name__}: {exc}", status=500, type=INTERNAL)


def validation_error(errors: Any) -> APIError:
    """Pydantic errors -> one 400 naming the first offending field in `param` (e.g. "max_tokens")."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return bad_request(f"Invalid JSON body: {detail}")
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return bad_request("The request body must be a JSON object")
    if kind == "missing" and not loc:
        return bad_request("The request body is empty; expected a JSON object")
    param = _param_name(loc)
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', '')}"
             for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    noun = "error" if len(errors) == 1 else "errors"
    return bad_request(f"{len(errors)} validation {noun}: " + "; ".join(parts) + more, param)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|bytes|(list|dict|set|tuple|literal|function-\w+|"
                        r"is-instance|json-or-python|nullable)\[.*\]|[A-Z]\w*)$")


def _param_name(loc: list[str]) -> str | None:
    """Drop pydantic's union-branch tags ("str", "list[int]", "TextPart") so param is the field path."""
    kept = [p for p in loc if not _UNION_TAG.match(p)]
    return ".".join(kept) or None


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so that no response leaves the app outside the envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ParamError)
    async def _param_error(_: Request, exc: ParamError) -> JSONResponse:
        return error_response(bad_request(str(exc), exc.param))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(CodecError)
    async def _unencodable(_: Request, exc: CodecError) -> JSONResponse:
        # Only a request's own free-form values (init_info, update_info, RPC arguments) can make a command
        # the bus cannot carry: msgpack integers are 64-bit.
        return error_response(bad_request(f"the request holds a value the engine's bus cannot carry ({exc}); "
                                          "integers must fit in 64 bits"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # vLLM: the HTTP phrase as type ("Not Found", "Method Not Allowed").
        phrase = HTTPStatus(exc.status_code).phrase
        body = envelope(str(exc.detail), phrase, exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("gateway.unhandled_error", path=request.url.path, error=repr(exc), exc_info=exc)
        return error_response(api_error_from(exc))
