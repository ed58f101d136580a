"""Development and RL endpoints (vLLM's dev router): pause/resume and the effective configuration.

Registered only in RL mode (rl_config.enabled) or with VLLM_SERVER_DEV_MODE=1; otherwise these paths
are 404. Every state change is one acknowledged broadcast through the coordinator: the call returns
when the scheduler and every worker have applied it, or fails with 504 naming who did not ack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from fastapi import FastAPI, Query, Request

from bus import control_state
from bus.control_state import SLEEP_TAGS
from bus.messages import (
    AnyResult,
    CollectiveRpc,
    CommandBody,
    ExtensionCall,
    ExtensionReturned,
    MemberEntry,
    Members,
    MemoryReleased,
    Pause,
    PrefixCacheReset,
    Quiesced,
    ReleaseMemory,
    ReloadWeightsCall,
    ResetPrefixCache,
    Resume,
    Sleep,
    UpdateWeightVersion,
    WakeUp,
    WeightsReloaded,
    WokeUp,
    WorkerInfo,
)
from engine.config import EngineConfig
from engine.rl_config import AdditionalConfig, determinism
from engine.weights.lifecycle import PAUSE_MODES, pause_deadline
from gateway.engine_client import EngineClient
from gateway.errors import bad_request, check_timeout, control_failure
from gateway.lora_routes import LORA_RPC
from gateway.responses import JSONResponse, dumps, loads
from gateway.serving import ModelInfo
from gateway.vllm_routes import vllm_config, vllm_config_text, vllm_env

DEV_PATHS = ("/pause", "/resume", "/is_paused", "/server_info", "/sleep", "/wake_up", "/is_sleeping",
             "/collective_rpc", "/abort_requests", "/weight_info", "/update_weight_version", "/reset_prefix_cache")
# SkyRL 0.4's worker-extension methods for a sync under a keep pause, answered natively (below)
SYNC_SLEEP, SYNC_WAKE = "skyrl_sleep_for_weight_sync", "skyrl_wake_for_weight_sync"
RPC_METHODS = ("reload_weights", SYNC_SLEEP, SYNC_WAKE)


def _bool(value: str, param: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise bad_request(f"{param} must be a boolean, got {value!r}", param)


async def broadcast(client: EngineClient, command: CommandBody, timeout_s: float) -> dict[str, AnyResult]:
    reply = await client.control(command, timeout_s=timeout_s)
    if not reply.ok:
        raise control_failure(command, reply)
    return reply.results


def add_dev_routes(app: FastAPI, cfg: EngineConfig, client: EngineClient, extra: AdditionalConfig,
                   model: ModelInfo) -> None:
    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: str = "true", timeout: float | None = None) -> JSONResponse:
        if mode not in PAUSE_MODES:
            raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        if timeout is not None:
            timeout = check_timeout(timeout, "timeout")
        command = Pause(mode, _bool(clear_cache, "clear_cache"))
        # wait mode may take as long as the longest running request; the default deadline is generous
        deadline = timeout if timeout is not None else pause_deadline(mode, cfg.bus.control_timeout_s)
        await broadcast(client, command, deadline)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await broadcast(client, Resume(), cfg.bus.control_timeout_s)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": client.paused})

    @app.post("/sleep")
    async def sleep(level: str = "1", mode: str = "abort") -> JSONResponse:
        if not cfg.rl.enable_sleep_mode:
            raise bad_request("sleep mode is not enabled: start the server with --enable-sleep-mode", "level")
        if level not in ("0", "1", "2"):
            raise bad_request(f"level must be 0, 1 or 2, got {level!r}", "level")
        if mode not in PAUSE_MODES:
            raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        results = await sleep_engine(client, cfg, int(level), mode, lora=getattr(app.state, "lora", None))
        released = sum(r.released_bytes for r in results.values() if isinstance(r, MemoryReleased))
        body = {"status": "sleeping", "level": int(level), "released_bytes": released}
        dropped = sorted({n for r in results.values() if isinstance(r, MemoryReleased) for n in r.lora_dropped})
        if dropped:  # pushed LoRA adapters a level-2 sleep dropped: push them again (docs/lora.md)
            body["lora_dropped"] = dropped
        return JSONResponse(body)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> JSONResponse:
        for t in tags or []:
            if t not in SLEEP_TAGS:
                raise bad_request(f"tags must be among {', '.join(SLEEP_TAGS)}, got {t!r}", "tags")
        results = await broadcast(client, WakeUp(tags), cfg.bus.control_timeout_s)
        restored = sum(r.restored_bytes for r in results.values() if isinstance(r, WokeUp))
        status = "sleeping" if client.control_state.sleeping_tags else "awake"
        return JSONResponse({"status": status, "tags": tags, "restored_bytes": restored})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": control_state.is_sleeping(client.control_state)})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await _json_object(request)
        method = body.get("method")
        if method is None:
            raise bad_request("Missing 'method' in request body", "method")
        extension = method not in ("reload_weights",) and await _extension_method(method)  # an extension's wins
        if method in (SYNC_SLEEP, SYNC_WAKE) and not extension:
            return JSONResponse(await sync_sleep_rpc(client, cfg, method, body, getattr(app.state, "lora", None)))
        if method in LORA_RPC and not extension:  # SkyRL's in-memory LoRA (gateway/lora_routes.py)
            lora_rpc = getattr(request.app.state, "lora_rpc", None)
            if lora_rpc is None:
                raise bad_request(f"{method}: this engine was started without --enable-lora", "method")
            kwargs = body.get("kwargs") or {}
            if not isinstance(kwargs, dict):
                raise bad_request("kwargs must be an object", "kwargs")
            timeout = check_timeout(body["timeout"], "timeout") if body.get("timeout") is not None else None
            return JSONResponse(await lora_rpc(method, kwargs, timeout))
        if method not in RPC_METHODS and not extension:
            raise bad_request(f"method must be one of {', '.join(RPC_METHODS + LORA_RPC)} or a public method of "
                              f"--worker-extension-cls, got {method!r}", "method")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise bad_request("args must be a list and kwargs an object", "args" if not isinstance(args, list)
                              else "kwargs")
        if not extension and (args or set(kwargs) - {"weights_path"}):
            raise bad_request("kwargs may only hold weights_path", "kwargs")
        if not extension and not isinstance(kwargs.get("weights_path", ""), str | None):
            raise bad_request("kwargs.weights_path must be a string (a model folder)", "kwargs.weights_path")
        timeout = check_timeout(body["timeout"], "timeout") if body.get("timeout") is not None else \
            cfg.bus.control_timeout_s * 6
        call = ExtensionCall(dumps(args).decode(), dumps(kwargs).decode()) if extension else \
            ReloadWeightsCall(kwargs.get("weights_path"))
        results = await broadcast(client, CollectiveRpc(method, call), timeout)
        workers = [r for n, r in sorted(results.items()) if n.startswith("worker")]
        if extension:
            return JSONResponse({"results": [r.value for r in workers if isinstance(r, ExtensionReturned)]})
        return JSONResponse({"results": [_reloaded_json(r) for r in workers if isinstance(r, WeightsReloaded)]})

    async def _extension_method(method: Any) -> bool:
        """Whether every worker has `method` from --worker-extension-cls (the workers report theirs)."""
        if not cfg.parallel.worker_extension_cls or not isinstance(method, str):
            return False
        infos = await _worker_infos()
        return bool(infos) and all(method in i.worker_extension_methods for i in infos.values())

    async def _worker_infos() -> dict[str, WorkerInfo]:
        """What every worker that is a member reported of itself in its Hello, by name."""
        reply = await client.control(Members(), timeout_s=cfg.bus.control_timeout_s)
        return {n: m.info for n, m in sorted(reply.results.items())
                if isinstance(m, MemberEntry) and isinstance(m.info, WorkerInfo)}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        body = await _json_object(request, allow_empty=True)
        ids = body.get("request_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
            raise bad_request("request_ids must be a list of strings", "request_ids")
        running = list(client.queues)
        # Engine ids are "<request id>-<choice index>"; match the ids clients know.
        hit = running if not ids else [r for r in running if any(r == i or r.startswith(i + "-") for i in ids)]
        if hit:
            await client.abort(hit)
        return JSONResponse({"status": "aborted", "aborted": len({r.rsplit("-", 1)[0] for r in hit})})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": client.control_state.weight_version})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _json_object(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise bad_request("new_version must be a non-empty string", "new_version")
        await broadcast(client, UpdateWeightVersion(version), cfg.bus.control_timeout_s)
        return JSONResponse({"success": True, "new_version": version})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request, reset_running_requests: str | None = None,
                                 reset_external: str | None = None) -> JSONResponse:
        """vLLM's: forget every cached prefix. {"success": false} while requests hold KV blocks (retry
        later), unless reset_running_requests=true, which first preempts them (they are recomputed).
        reset_external resets a KV connector's cache: there is none here, so it succeeds (as vLLM).
        The options come as query parameters (vLLM reads only those) or in a JSON body (SkyRL sends
        {"reset_running_requests": true}, which vLLM silently drops): both are honoured."""
        query = {"reset_running_requests": reset_running_requests, "reset_external": reset_external}
        options = _query_or_body_bools(query, await _json_object(request, allow_empty=True))
        results = await broadcast(client, ResetPrefixCache(options["reset_running_requests"]),
                                  cfg.bus.control_timeout_s)
        ok = [r.success for r in results.values() if isinstance(r, PrefixCacheReset)]
        return JSONResponse({"success": bool(ok) and all(ok)})

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> JSONResponse:
        if config_format not in ("text", "json"):
            raise bad_request(f"config_format must be text or json, got {config_format!r}", "config_format")
        engine = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
        workers = {n: _worker_json(i) for n, i in (await _worker_infos()).items()}
        wt = cfg.rl.weight_transfer_config
        vc = vllm_config(cfg, model, workers, None if wt is None else {"backend": wt.name})
        return JSONResponse({
            # vLLM's keys first: its VllmConfig (text by default, JSON with config_format=json), VLLM_* env
            "vllm_config": vc if config_format == "json" else vllm_config_text(vc),
            "vllm_env": vllm_env(),
            "workers": workers,  # each one's device, dtype (what weight updates must send), KV blocks
            "engine_config": engine,
            "rl_config": extra.rl.effective(),
            # asked for (rl_config / VLLM_BATCH_INVARIANT) and active: every worker runs the invariant kernels
            "determinism": {**determinism(extra).as_json(), "batch_invariant_active": bool(workers) and all(
                w.get("kernels") == "batch_invariant" for w in workers.values())},
            "ascend_config": {"weight_nz_mode": extra.weight_nz_mode},
            "control_state": control_state.as_json(client.control_state),
        })


def _reloaded_json(r: WeightsReloaded) -> dict[str, Any]:
    """A worker's reload_weights result as /collective_rpc returns it."""
    out: dict[str, Any] = {"loaded_tensors": r.loaded_tensors}
    if r.weights is not None:
        out.update(weights_missing=r.weights.missing, weights_total=r.weights.total)
    return out


def _worker_json(info: WorkerInfo) -> dict[str, Any]:
    """/server_info's entry of a worker: its report as JSON, without the tag and the Hello's bus position."""
    out = msgspec.to_builtins(info)
    for key in ("type", "joined_seq"):
        out.pop(key, None)
    return out


def _query_or_body_bools(query: dict[str, str | None], body: dict[str, Any]) -> dict[str, bool]:
    """A route's boolean options (default false) from its query parameters or its JSON body, under the same
    names: the body's values are JSON booleans; an option given both ways must say the same thing."""
    for key in body:
        if key not in query:
            raise bad_request(f"unknown option {key!r}: this route takes {', '.join(query)}", key)
    options = {}
    for name, text in query.items():
        from_query = None if text is None else _bool(text, name)
        from_body = body.get(name)
        if from_body is not None and not isinstance(from_body, bool):
            raise bad_request(f"{name} must be a boolean (true or false), got {from_body!r} in the body", name)
        if from_query is not None and from_body is not None and from_query != from_body:
            raise bad_request(f"{name} is {str(from_query).lower()} in the query but {str(from_body).lower()} "
                              f"in the body: give it once, or the same in both", name)
        options[name] = bool(from_body if from_query is None else from_query)
    return options


async def sleep_engine(client: EngineClient, cfg: EngineConfig, level: int, mode: str, offload_kv: bool = False,
                       timeout_s: float | None = None, lora: Any = None) -> dict[str, Any]:
    """/sleep's two broadcasts: first every member quiesces (the scheduler acks once no step runs; with
    offload_kv it names the KV blocks its kept requests hold), then the workers release memory, which is only
    safe once nothing can touch it. Returns the release's results by member."""
    deadline = timeout_s or pause_deadline(mode, cfg.bus.control_timeout_s)
    quiet = await broadcast(client, Sleep(level, mode, offload_kv), deadline)
    blocks = {n: r.kv_blocks for n, r in quiet.items() if isinstance(r, Quiesced) and r.kv_blocks is not None}
    results = await broadcast(client, ReleaseMemory(level, offload_kv, blocks), timeout_s or cfg.bus.control_timeout_s)
    if lora is not None:  # level 2: pushed adapters must be pushed again (gateway/lora_routes.py)
        lora.dropped({n for r in results.values() if isinstance(r, MemoryReleased) for n in r.lora_dropped})
    return results


async def sync_sleep_rpc(client: EngineClient, cfg: EngineConfig, method: str, body: dict[str, Any],
                         lora: Any = None) -> dict:
    """SkyRL 0.4's skyrl_sleep_for_weight_sync(offload_kv=True) and skyrl_wake_for_weight_sync(tags), which on
    vLLM are methods of SkyRL's worker extension (its RemoteInferenceClient sends them through
    /collective_rpc): free memory for a weight sync while the requests a keep pause froze stay. The sleep
    is a level-2 sleep in keep mode (the weights are discarded: every parameter must come back through the
    sync, else requests are 503) that keeps the frozen requests' KV (offload_kv: copied to the host, put back
    by the kv_cache wake) or drops it (they recompute it from their tokens). The wake is /wake_up by tags; it
    does not resume (SkyRL calls /resume). Answers vLLM's shape: one null result per worker."""
    if not cfg.rl.enable_sleep_mode:
        raise bad_request(f"{method} needs sleep mode: start the server with --enable-sleep-mode", "method")
    args, kwargs = body.get("args") or [], body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise bad_request("args must be a list and kwargs an object", "args" if not isinstance(args, list)
                          else "kwargs")
    name = "offload_kv" if method == SYNC_SLEEP else "tags"
    if set(kwargs) - {name}:
        extra = sorted(set(kwargs) - {name})
        raise bad_request(f"{method} takes only {name}; got kwargs {', '.join(extra)}", f"kwargs.{extra[0]}")
    if len(args) > 1 or (args and name in kwargs):
        raise bad_request(f"{method} takes one argument, {name}: got {len(args)} positional args", "args")
    value = args[0] if args else kwargs.get(name, True if method == SYNC_SLEEP else None)
    timeout = check_timeout(body["timeout"], "timeout") if body.get("timeout") is not None else None
    if method == SYNC_SLEEP:
        if not isinstance(value, bool):
            raise bad_request(f"kwargs.offload_kv must be true or false, got {value!r}", "kwargs.offload_kv")
        results = await sleep_engine(client, cfg, 2, "keep", offload_kv=value, timeout_s=timeout, lora=lora)
    else:
        if value is not None and (not isinstance(value, list) or not all(t in ("weights", "kv_cache") for t in value)):
            raise bad_request(f"kwargs.tags must be a list of weights and/or kv_cache, got {value!r}", "kwargs.tags")
        results = await broadcast(client, WakeUp(value), timeout or cfg.bus.control_timeout_s)
    return {"results": [None for n in sorted(results) if n.startswith("worker")]}


async def _json_object(request: Request, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return {}
    try:
        body = loads(raw)
    except ValueError as e:
        raise bad_request(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body
