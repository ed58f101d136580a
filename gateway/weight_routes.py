"""Weight-transfer endpoints, vLLM v0.33's RL router: each route is one acked broadcast to every worker.

    POST /init_weight_transfer_engine {"init_info": {...}}   rendezvous (collectives) or set packing (ipc)
    POST /start_weight_update                                 the scheduler holds steps until commit/abort
    POST /update_weights {"update_info": {...} | [...]}       checked here and on every worker, then written
    POST /finish_weight_update {"weight_version": "..."}      every worker finished -> commit (new epoch)
        {"commit": false}: rollbus's own, every worker finished (verified), nothing committed yet
    POST /commit_weight_update {"weight_version": "..."}      rollbus's own: commit what finish verified
    POST /abort_weight_update                                 rollbus's own: drop the update in progress
    POST /push_lora_adapter {"receive_target", "updates", "weight_version"}   rollbus's own: a LoRA adapter's
        whole update in one call (arm, start, each update_info, finish, commit; any failure aborts it)
    POST /shutdown_weight_transfer_engine
    GET  /get_world_size?include_dp=true
    GET  /weight_commit_info, GET /weight_copy?worker=N     rollbus's own: a restarted peer's catch-up
    POST /weight_checker {"action": "checksum"|"compare"|"reset", "baseline": {...}}

The two rollbus-only steps make a fleet update two-phase (engine.trainer.fleet): every engine finishes without
committing, then every engine commits; any refusal before that aborts them all.
init_info / update_info are decoded here, once, into the backend's typed structs (engine.weights.wire: a
400 naming the field; a refused update_info still reaches the workers as a RefusedUpdate, so a collective
trainer's broadcasts are drained). Each step follows engine.weights.lifecycle: a failed step aborts the
update on every worker when `abort_needed` says so, and answers with the worker's status and message.
Registered with the other development endpoints (RL mode or VLLM_SERVER_DEV_MODE=1).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from bus.control_state import RESET_VERSION
from bus.messages import (
    AbortWeightUpdate,
    Checksums,
    CommandBody,
    CommitWeightUpdate,
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightVersion,
    WeightChecker,
)
from bus.topology import Topology
from engine.config import EngineConfig
from engine.fleet.rejoin import FleetRecord, read_fleet_record, write_fleet_record
from engine.weights import backends
from engine.weights.lifecycle import Deadlines, abort_needed
from engine.weights.wire import NOT_CONFIGURED, WeightSyncError, decode_init, decode_update
from gateway.dev_routes import _bool, _json_object, broadcast
from gateway.engine_client import EngineClient
from gateway.errors import CONFLICT, APIError, bad_request, check_timeout, control_failure
from gateway.responses import JSONResponse
from gateway.weight_copy_route import add_weight_copy_route

WEIGHT_PATHS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                "/finish_weight_update", "/commit_weight_update", "/abort_weight_update", "/push_lora_adapter",
                "/shutdown_weight_transfer_engine", "/get_world_size", "/weight_checker", "/weight_commit_info",
                "/weight_copy")
CHECKER_ACTIONS = ("checksum", "compare", "reset")


def add_weight_routes(app: FastAPI, cfg: EngineConfig, client: EngineClient) -> None:
    wt = cfg.rl.weight_transfer_config
    steps = Deadlines(cfg.bus.control_timeout_s, *([wt.timeout_s] if wt else []))
    # the last checksums and the command seq before they were asked for: valid while no command but that
    # WeightChecker itself followed (a reload_weights or a sleep changes weights without a new epoch);
    # /weight_checker reset drops them
    checksums: dict[int, tuple[dict[str, str], dict[str, str]]] = {}  # seq -> (listed, stacked experts)
    # finish_weight_update {"commit": false} verified the update in progress: commit_weight_update may commit it
    # (and the version it named, which commit_weight_update uses unless it names one itself)
    verified: dict[str, Any] = {"update": False, "version": None}

    def lora_update(ended: bool) -> None:
        """An update that built a LoRA adapter version (gateway/lora_routes.py) registers it when it commits."""
        lora = getattr(app.state, "lora", None)
        if lora is not None:
            lora.committed() if ended else lora.aborted()

    async def step(command: CommandBody) -> None:
        """One step of the update with its deadline (engine.weights.lifecycle); on failure, abort when the rule
        says so."""
        reply = await client.control(command, timeout_s=steps(command).timeout_s)
        if not reply.ok:
            e = control_failure(command, reply)
            if abort_needed(command, e.status, reply.errors):
                lora_update(False)
                try:
                    await broadcast(client, AbortWeightUpdate(), steps.control_s)
                except APIError:
                    pass  # the original failure is what the caller needs to see
            raise e

    def payload(body: dict[str, Any], field: str) -> Any:
        """The body's init_info / update_info, before the edge decodes it (engine.weights.wire)."""
        raw = body.get(field)
        if raw is None:
            raise bad_request(f"Missing '{field}' in request body", field)
        if wt is None:
            raise bad_request(NOT_CONFIGURED)
        return raw

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> JSONResponse:
        raw = payload(await _json_object(request), "init_info")
        if not isinstance(raw, dict):
            raise bad_request("init_info must be an object", "init_info")
        timeout = check_timeout(raw.get("timeout_s", steps.transfer_timeout_s), "timeout_s")
        try:
            info = decode_init(raw, backends.init_struct(wt.backend))
        except WeightSyncError as e:
            raise bad_request(str(e), e.param) from None
        await broadcast(client, InitWeightTransferEngine(info), timeout + steps.control_s)
        return JSONResponse({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update() -> JSONResponse:
        await step(StartWeightUpdate())
        verified["update"] = False  # (a start refused while a verified update is open leaves it verified)
        return JSONResponse({"message": "Weight update started"})

    def update_info(raw: Any) -> Any:
        if not isinstance(raw, dict | list) or (isinstance(raw, list) and not all(isinstance(i, dict) for i in raw)):
            raise bad_request("update_info must be an object, or a list of objects (one per worker)", "update_info")
        # a refusal travels on to the workers (a RefusedUpdate): they drain the trainer's broadcasts, then fail
        cls = backends.update_struct(wt.backend)
        return [decode_update(i, cls) for i in raw] if isinstance(raw, list) else decode_update(raw, cls)

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        await step(UpdateWeights(update_info(payload(await _json_object(request), "update_info"))))
        return JSONResponse({"message": "Weights updated"})

    @app.post("/push_lora_adapter")
    async def push_lora_adapter(request: Request) -> JSONResponse:
        """rollbus's own: engine.trainer's send_lora in one call instead of five (the receive target of
        /collective_rpc's skyrl_set_lora_receive_target, then start, one update_weights per entry of
        `updates`, finish and commit, as the separate routes do them). All or nothing: a failure at any
        step aborts the update and disarms the target; the version that served keeps serving."""
        body, version = await _versioned(request)
        rpc = getattr(app.state, "lora_rpc", None)
        if rpc is None:
            raise bad_request("push_lora_adapter needs --enable-lora", "receive_target")
        raws = payload(body, "updates")
        if not isinstance(raws, list) or not raws:
            raise bad_request("updates must be a non-empty list of update_info values (one per update_weights "
                              "call)", "updates")
        unknown = sorted(set(body) - {"receive_target", "updates", "weight_version"})
        if unknown:
            raise bad_request(f"unknown field(s) {unknown}; known: receive_target, updates, weight_version",
                              unknown[0])
        infos = [update_info(raw) for raw in raws]
        await rpc("skyrl_set_lora_receive_target", {"receive_target": body.get("receive_target")})
        try:
            await step(StartWeightUpdate())
            verified["update"] = False
            for info in infos:
                await step(UpdateWeights(info))
            await step(FinishWeightUpdate())
        except BaseException:
            lora_update(False)
            try:  # disarm (a no-op where the failed step already aborted)
                await broadcast(client, AbortWeightUpdate(), steps.control_s)
            except APIError:
                pass
            raise
        await _commit(version)
        return JSONResponse({"message": "LoRA adapter pushed"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> JSONResponse:
        body, version = await _versioned(request)
        commit_now = body.get("commit", True)
        if not isinstance(commit_now, bool):
            raise bad_request("commit must be true or false", "commit")
        await step(FinishWeightUpdate())
        if not commit_now:  # rollbus's own first phase: every worker holds the update, none serves it yet
            verified.update(update=True, version=version)
            return JSONResponse({"message": "Weight update verified; commit_weight_update or abort_weight_update"})
        await _commit(version)
        return JSONResponse({"message": "Weight update finished"})

    @app.post("/commit_weight_update")
    async def commit_weight_update(request: Request) -> JSONResponse:
        # not vLLM's: the second phase of a fleet update, once every engine verified its part. "fleet": the
        # other engines' URLs, kept beside the recovery copies for a restart (engine.fleet.rejoin)
        body, version = await _versioned(request)
        peers = body.get("fleet", [])
        if not isinstance(peers, list) or not all(isinstance(p, str) and p.startswith(("http://", "https://"))
                                                  for p in peers):
            raise bad_request("fleet must be a list of the other engines' URLs (http:// or https://)", "fleet")
        if not verified["update"] or not client.control_state.weight_update_active:
            raise APIError("no verified weight update to commit: finish_weight_update with {\"commit\": false} "
                           "first", status=409, type=CONFLICT)
        await _commit(version or verified["version"], tuple(peers))
        return JSONResponse({"message": "Weight update committed"})

    async def _commit(version: str | None, peers: tuple[str, ...] = ()) -> None:
        verified["update"] = False
        try:
            await broadcast(client, CommitWeightUpdate(version or ""), steps.control_s)
        except APIError:
            lora_update(False)
            raise
        lora_update(True)
        committed = (version or client.control_state.weight_version, time.time())
        app.state.weights_committed = committed
        if folder := cfg.rl.weights_recovery_dir:  # beside the copies: when, and the fleet it was last part of
            last = read_fleet_record(folder)
            write_fleet_record(folder, FleetRecord(*committed, peers or (last.peers if last else ())))

    @app.post("/abort_weight_update")
    async def abort_weight_update() -> JSONResponse:
        # not vLLM's: a fleet trainer (several engines, one update) drops an engine's staged update when
        # another engine refused its part; the previous weights stay in service. Without an update: a no-op.
        verified["update"] = False
        await broadcast(client, AbortWeightUpdate(), steps.control_s)
        lora_update(False)
        return JSONResponse({"message": "Weight update aborted"})

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> JSONResponse:
        await broadcast(client, ShutdownWeightTransferEngine(), steps.control_s)
        return JSONResponse({"message": "Weight transfer shut down"})

    @app.get("/weight_commit_info")
    async def weight_commit_info() -> JSONResponse:
        # rollbus's own (vLLM's /weight_info says only the label): the version in service and when this engine
        # committed it (epoch seconds; None: unknown, e.g. the checkpoint, or lost), which a restarted peer
        # compares with its own last fleet commit (engine.fleet.rejoin)
        state = client.control_state
        at = None if state.weights_lost else committed_at(state.weight_version)
        return JSONResponse({"weight_version": state.weight_version, "committed_at": at})

    def committed_at(version: str) -> float | None:
        """This gateway's last commit, else (after a restart) the fleet record beside the copies."""
        last = getattr(app.state, "weights_committed", None)
        if last is not None and last[0] == version:
            return last[1]
        folder = cfg.rl.weights_recovery_dir
        record = read_fleet_record(folder) if folder else None
        return record.committed_at if record is not None and record.weight_version == version else None

    add_weight_copy_route(app, cfg, client)

    @app.get("/get_world_size")
    async def get_world_size(include_dp: str = "true") -> JSONResponse:
        # vLLM's: TP * PP * DP with include_dp (the trainer-facing world size minus the trainer), else TP * PP
        topo = Topology.from_config(cfg)
        return JSONResponse({"world_size": topo.world_size if _bool(include_dp, "include_dp") else topo.tp})

    @app.post("/weight_checker")
    async def weight_checker(request: Request) -> JSONResponse:
        body = await _json_object(request)
        action = body.get("action")
        if action not in CHECKER_ACTIONS:
            raise bad_request(f"action must be one of {', '.join(CHECKER_ACTIONS)}, got {action!r}", "action")
        if action == "reset":  # vLLM's zero_weights: every weight zeroed, so reset -> sync -> compare proves
            # that the sync wrote every tensor; nothing is served (503) until a full update fills them
            await broadcast(client, WeightChecker("reset"), steps.control_s)
            await broadcast(client, UpdateWeightVersion(RESET_VERSION), steps.control_s)
            checksums.clear()
            return JSONResponse({"status": "reset"})
        baseline = body.get("baseline")
        if action == "compare" and not isinstance(baseline, dict):
            raise bad_request("compare needs a baseline object {name: sha256 hex}", "baseline")
        seq = client.follower.seq or 0
        asked = next(iter(checksums), None)
        if asked is None or seq > asked + 1:
            results = await broadcast(client, WeightChecker("checksum"), steps.transfer_s)
            merged: dict[str, str] = {}
            stacked: dict[str, str] = {}
            for r in results.values():
                if isinstance(r, Checksums):
                    merged.update(r.checksums)
                    stacked.update(r.stacked)
            checksums.clear()
            checksums[seq] = (merged, stacked)
            asked = seq
        current, stacked = checksums[asked]
        if action == "checksum":
            return JSONResponse({"checksums": current})
        every = {**current, **stacked}  # a baseline from named_parameters() names MoE experts stacked
        mismatches = sorted(k for k, v in baseline.items() if not _matches(every, k, v))
        return JSONResponse({"match": not mismatches, "mismatches": mismatches})


async def _versioned(request: Request) -> tuple[dict[str, Any], str | None]:
    """A finish or commit body (optional) and its weight_version (optional, a non-empty string)."""
    body = await _json_object(request, allow_empty=True)
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, str) or not version):
        raise bad_request("weight_version must be a non-empty string", "weight_version")
    return body, version


def _matches(current: dict[str, str], key: str, value: Any) -> bool:
    """A baseline key is either a worker-prefixed key ("dp0:pp0:pcp0:tp0:<name>") or a bare tensor name,
    which must match on every worker."""
    if key in current:
        return current[key] == value
    hits = [v for k, v in current.items() if k.endswith(":" + key)]
    return bool(hits) and all(v == value for v in hits)
