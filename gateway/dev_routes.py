"""Development and RL endpoints (vLLM's dev router): pause/resume and the effective configuration.

Registered only in RL mode (rl_config.enabled) or with VLLM_SERVER_DEV_MODE=1; otherwise these paths
are 404. Every state change is one acknowledged broadcast through the coordinator: the call returns
when the scheduler and every worker have applied it, or fails with 504 naming who did not ack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.config import EngineConfig
from engine.control_state import PAUSE_MODES
from engine.rl_config import AdditionalConfig
from gateway.engine_client import EngineClient
from gateway.errors import APIError, bad_request

DEV_PATHS = ("/pause", "/resume", "/is_paused", "/server_info")
GATEWAY_TIMEOUT = "GatewayTimeoutError"


def _bool(value: str, param: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise bad_request(f"{param} must be a boolean, got {value!r}", param)


async def broadcast(client: EngineClient, command: str, args: dict[str, Any], timeout_s: float) -> dict:
    reply = await client.control(command, args, timeout_s=timeout_s)
    if not reply.ok:
        status = 504 if reply.missing else 500
        raise APIError(f"{command} failed: {reply.error}", status=status,
                       type=GATEWAY_TIMEOUT if reply.missing else "InternalServerError")
    return reply.results


def add_dev_routes(app: FastAPI, cfg: EngineConfig, client: EngineClient, extra: AdditionalConfig) -> None:
    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: str = "true", timeout: float | None = None) -> JSONResponse:
        if mode not in PAUSE_MODES:
            raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        if timeout is not None and timeout <= 0:
            raise bad_request(f"timeout must be positive, got {timeout}", "timeout")
        args = {"mode": mode, "clear_cache": _bool(clear_cache, "clear_cache")}
        # wait mode may take as long as the longest running request; the default deadline is generous
        deadline = timeout if timeout is not None else (3600.0 if mode == "wait" else cfg.control_timeout_s)
        await broadcast(client, "pause", args, deadline)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await broadcast(client, "resume", {}, cfg.control_timeout_s)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": client.paused})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        engine = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
        return JSONResponse({
            "engine_config": engine,
            "rl_config": extra.rl.effective(),
            "ascend_config": {"weight_nz_mode": extra.weight_nz_mode},
            "control_state": client.control_state,
        })
