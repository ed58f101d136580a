"""The FastAPI app: vLLM's routes (/v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /health,
/ping, /version, /metrics), the --api-key check, and the error envelope. Handlers live in serving_*.py.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bus import control_state
from bus.messages import Health, HealthReport
from engine.config import EngineConfig
from engine.rl_config import dev_endpoints_enabled
from gateway.dev_routes import DEV_PATHS, add_dev_routes
from gateway.dp_middleware import DataParallelRankMiddleware
from gateway.engine_client import EngineClient
from gateway.errors import UNAUTHORIZED, envelope, install_error_handlers
from gateway.limits import Admission, BodyTooLarge, LoadLimitMiddleware, too_large
from gateway.lora_routes import add_lora_routes, lora_registry
from gateway.memory import HeapTrimmer
from gateway.metrics import Metrics
from gateway.openapi import install_openapi
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completions import CompletionRequest
from gateway.protocol.generate import GenerateRequest
from gateway.responses import JSONResponse
from gateway.responses_protocol import ResponsesRequest
from gateway.responses_store import ResponseStore
from gateway.serving import ModelInfo, ServingContext
from gateway.serving_chat import create_chat_completion
from gateway.serving_completions import create_completion
from gateway.serving_generate import abort_requests, create_generate
from gateway.serving_responses import cancel_response, create_response, retrieve_response
from gateway.skyrl_routes import add_skyrl_routes
from gateway.vllm_routes import add_vllm_routes
from gateway.weight_routes import WEIGHT_PATHS, add_weight_routes

log = structlog.get_logger()


def rollbus_version() -> str:
    """The installed distribution's version, else the one in the source tree's pyproject.toml."""
    import importlib.metadata

    try:
        return importlib.metadata.version("rollbus")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, ImportError, ValueError):
        return "unknown"


class APIKeyMiddleware:
    """vLLM's --api-key: every /v1 (and dev) request needs `Authorization: Bearer KEY`, else 401."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            root = scope.get("root_path", "")
            # Beyond vLLM (whose dev routes take no key): with --api-key the dev endpoints need it too.
            if path.startswith((f"{root}/v1", f"{root}/inference")) or \
                    path.removeprefix(root) in DEV_PATHS + WEIGHT_PATHS:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    resp = JSONResponse(envelope("Unauthorized", UNAUTHORIZED, 401), status_code=401)
                    await resp(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class HealthProbe:
    """/health asks every engine process to ack; concurrent probes share one broadcast."""

    def __init__(self, client: EngineClient, timeout_s: float):
        self.client, self.timeout_s = client, timeout_s
        self._inflight: asyncio.Task[bool] | None = None

    async def _probe(self) -> bool:
        try:
            reply = await self.client.control(Health(), timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            log.warning("gateway.health_failed", error=repr(e))
            return False
        if not reply.ok:
            log.warning("gateway.unhealthy", error=reply.error, missing=reply.missing)
            return False
        # Healthy means the engine can serve: a scheduler and at least one worker acked (under honcho
        # the gateway can be up before they have joined) and none of them reported a problem.
        roles = {name.split("-")[0] for name in reply.results}
        if not {"scheduler", "worker"} <= roles:
            log.info("gateway.not_ready", joined=sorted(reply.results))
            return False
        return all(r.ok for r in reply.results.values() if isinstance(r, HealthReport))

    async def check(self) -> bool:
        if not self.client.healthy or not all(getattr(self.client, "engines_alive", lambda: [True])()):
            return False  # (every data-parallel engine must be whole, as the one engine must be)
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.create_task(self._probe())
        return await asyncio.shield(self._inflight)


def build_app(cfg: EngineConfig, client: EngineClient, tokenizer: Any, model_info: ModelInfo, *,
              manage_client: bool = True) -> FastAPI:
    """The gateway's app. With manage_client, the app's lifespan starts and closes the EngineClient."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await client.start()
        try:
            yield
        finally:
            if manage_client:
                await client.close()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if cfg.gateway.disable_fastapi_docs else {}
    app = FastAPI(title="rollbus", version=rollbus_version(), lifespan=lifespan, default_response_class=JSONResponse,
                  **docs)
    install_error_handlers(app)
    admission = Admission(cfg.gateway.max_num_queued_reqs, cfg.gateway.max_num_queued_tokens)
    app.state.admission = admission

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, __: BodyTooLarge) -> Response:
        return too_large(cfg.gateway.max_request_body_bytes)

    app.state.trimmer = trimmer = HeapTrimmer(lambda: admission.requests)
    app.add_middleware(LoadLimitMiddleware, admission=admission, max_body_bytes=cfg.gateway.max_request_body_bytes,
                       trimmer=trimmer)
    # X-data-parallel-rank (test fakes of the client have one engine)
    app.add_middleware(DataParallelRankMiddleware, num_engines=getattr(client, "num_engines", 1))
    if cfg.gateway.api_key:  # added last = outermost: a request without the key is 401 before any limit applies
        app.add_middleware(APIKeyMiddleware, api_key=cfg.gateway.api_key)
    extra = cfg.rl.additional_config
    if dev_endpoints_enabled(extra):
        log.warning("gateway.dev_endpoints", message="SECURITY WARNING: Development endpoints are enabled!",
                    paths=list(DEV_PATHS + WEIGHT_PATHS))
        if not cfg.gateway.api_key and cfg.gateway.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("gateway.dev_endpoints_exposed",
                        message=f"development endpoints listen on {cfg.gateway.host} without --api-key: anyone who can "
                                "reach this port can pause the engine")
        add_dev_routes(app, cfg, client, extra, model_info)
        add_weight_routes(app, cfg, client)
    metrics = Metrics(model_info.names[0], stats=lambda: getattr(client, "engine_stats", None) or [client.stats],
                      healthy=lambda: client.healthy,
                      sleep_state=lambda: control_state.sleep_state_label(client.control_state),
                      open_sequences=lambda: admission.sequences,
                      open_engine_requests=lambda: len(getattr(client, "queues", ())),  # (test fakes have none)
                      num_engines=getattr(client, "num_engines", 1))
    ctx = ServingContext(cfg, client, tokenizer, model_info, metrics, admission)
    ctx.lora = lora_registry(cfg, model_info.names, model_info.root)  # --enable-lora (gateway/lora_routes.py)
    add_lora_routes(app, ctx.lora, client, cfg.bus.control_timeout_s)
    health = HealthProbe(client, cfg.bus.control_timeout_s)
    created = int(time.time())
    app.state.serving = ctx
    add_vllm_routes(app, ctx)  # /tokenize, /detokenize, /v1/chat/completions/render, /v1/completions/render
    add_skyrl_routes(app, ctx)  # /skyrl/v1/generate (SkyRL's server actor's route; docs/fleet.md)
    # /openapi.json with the bodies the routes read themselves
    install_openapi(app, cfg, model_info)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        data = [{"id": name, "object": "model", "created": created, "owned_by": "rollbus",
                 "root": model_info.root, "parent": None, "max_model_len": model_info.max_model_len,
                 "permission": [_permission(created)]} for name in model_info.names]
        if ctx.lora is not None:
            data += ctx.lora.cards(created, _permission(created))
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = CompletionRequest.model_validate_json(await request.body())
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = ChatCompletionRequest.model_validate_json(await request.body())
        return await create_chat_completion(ctx, body, request)

    # The Responses API (docs/openai-api.md): responses kept in this gateway's memory, bounded
    app.state.responses_store = responses_store = ResponseStore(cfg.gateway.max_stored_responses)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = ResponsesRequest.model_validate_json(await request.body())
        return await create_response(ctx, responses_store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str, stream: bool | None = None,
                                 starting_after: int | None = Query(None, ge=0)) -> Response:
        return await retrieve_response(responses_store, response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str) -> Response:
        return await cancel_response(responses_store, response_id)

    # Tokens in, tokens out (docs/tokens.md): always routed, 403 unless scale-out is on (vLLM v0.33).
    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = GenerateRequest.model_validate_json(await request.body())
        return await create_generate(ctx, body, request)

    @app.post("/inference/v1/abort_requests")
    async def generate_abort(request: Request) -> Response:
        return await abort_requests(ctx, request)

    if cfg.rl.tokens_only and not dev_endpoints_enabled(extra):
        # vLLM's legacy tokens-only abort route, unless the RL router already owns the path
        app.add_api_route("/abort_requests", generate_abort, methods=["POST"])

    @app.get("/health")
    async def health_route() -> Response:
        return Response(status_code=200 if not admission.draining and await health.check() else 503)

    @app.get("/ping")
    @app.post("/ping")  # two routes, so /openapi.json gives each method its own operation id
    async def ping() -> Response:
        return Response(status_code=200 if not admission.draining and await health.check() else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": app.version})

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        body, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app


def _permission(created: int) -> dict[str, Any]:
    """vLLM's (and OpenAI's legacy) model permission record; clients still parse it."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
