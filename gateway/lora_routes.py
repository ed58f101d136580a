"""LoRA adapters in the gateway: the registry of served adapters (name -> id, folder, version) and vLLM's
routes for it, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM; 404 otherwise, since the routes do not exist).

An adapter is checked against the model (engine.lora.inspect_adapter) before it is registered: a bad one is
a 400 naming the adapter and the cause, and what was registered before keeps serving. A request names an
adapter as its `model`; its SamplingParams then carry the adapter's LoraRef (id and current version), which
the scheduler puts into the prefix-cache key and the workers use to pick the weights (workers/lora.py).
`load_inplace: true` on a registered name makes a new version: requests from then on run on the new
weights, requests already running finish on the version they started with.

Adapters over the weight-transfer path (SkyRL's in-memory LoRA sync; engine.trainer's send_lora): POST
/collective_rpc {"method": "skyrl_set_lora_receive_target", "kwargs": {"receive_target": {"kind": "lora",
"lora_name", "adapter_config", "aliases"}}} checks the config here and arms every worker for the next update
with the adapter's next version (workers/lora_stage.py); the update then runs as any other (all or nothing)
and its commit registers that version here. POST /skyrl/v1/load_lora_adapter (SkyRL's own route) takes
{"lora_name", "in_memory": true} (the version the update registered) or {"lora_name", "lora_path"}.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response

from bus.messages import CollectiveRpc, ExtensionReturned, LoraTargetCall
from bus.sampling_params import LoraRef
from engine.lora import (
    MEMORY_PREFIX,
    LoraError,
    adapter_factors,
    inspect_adapter,
    parse_lora_modules,
    runtime_updates_allowed,
)
from gateway.errors import APIError, bad_request, control_failure

INVALID, NOT_FOUND = "InvalidUserInput", "NotFoundError"
log = structlog.get_logger()


class LoraRegistry:
    def __init__(self, cfg: Any, base_names: list[str], model_root: str):
        self.cfg, self.base_names = cfg, base_names
        cfg_file = Path(model_root) / "config.json"
        self.hf_config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.adapters: dict[str, tuple[LoraRef, str]] = {}  # name -> (ref, parent model name)
        self.next_id = 1
        self.lock = asyncio.Lock()
        self.armed: dict[str, LoraRef] = {}  # name -> the version the next weight update builds
        self.memory_ids: dict[str, int] = {}  # pushed adapters' ids, kept after an unload (discard needs them)
        self.to_push: set[str] = set()  # pushed adapters a level-2 sleep dropped, until pushed again

    def ref(self, model: str | None) -> LoraRef | None:
        if model in self.to_push:
            raise APIError(f"LoRA adapter '{model}' was dropped by a level-2 sleep with the weights (a trainer pushed "
                           "it; it has no folder to be read again from): push it again", status=400, type=INVALID,
                           param="model")
        entry = self.adapters.get(model or "")
        return entry[0] if entry else None

    def cards(self, created: int, permission: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "rollbus", "root": ref.path,
                 "parent": parent, "max_model_len": None, "permission": [permission]}
                for name, (ref, parent) in self.adapters.items()]

    def load(self, name: str, path: str, inplace: bool = False, parent: str | None = None) -> str:
        """Check and register (or, in place, replace) an adapter; APIError with vLLM's status and text."""
        if not name or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.", status=400, type=INVALID)
        if name in self.base_names:
            raise APIError(f"The lora adapter '{name}' conflicts with a served base model.", status=400, type=INVALID)
        if not inplace and name in self.adapters:
            raise APIError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                           "place, set 'load_inplace' to True.", status=400, type=INVALID)
        try:
            if not self.hf_config:
                raise LoraError(f"Loading lora {name} failed: the model has no config.json to check it against")
            inspect_adapter(name, path, self.hf_config, self.cfg.lora.max_lora_rank)
        except FileNotFoundError:
            raise APIError(f"Loading lora {name} failed: No adapter found for {path}", status=404,
                           type=NOT_FOUND) from None
        except LoraError as e:
            raise APIError(str(e), status=400, param="lora_path") from None
        old = self.adapters.get(name)
        if old is None:
            ref = LoraRef(self.memory_ids.get(name) or self._new_id(), name, path, 1)
        else:
            ref = LoraRef(old[0].id, name, path, old[0].version + 1)
        self.adapters[name] = (ref, parent if parent in self.base_names else self.base_names[0])
        log.info("gateway.lora_loaded", lora_name=name, lora_path=path, lora_int_id=ref.id, version=ref.version)
        return f"Success: LoRA adapter '{name}' added successfully."

    def arm(self, target: Any) -> LoraTargetCall:
        """SkyRL's receive target, checked: the adapter's next version, for the workers to build."""
        if not isinstance(target, dict) or target.get("kind") != "lora":
            raise bad_request(f"Not a LoRA receive target: {target!r}", "kwargs.receive_target")
        name, conf, aliases = target.get("lora_name"), target.get("adapter_config"), target.get("aliases") or {}
        if not isinstance(name, str) or not name:
            raise bad_request("receive_target.lora_name must be a non-empty string", "kwargs.receive_target")
        if name in self.base_names:
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model.", "kwargs.receive_target")
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in aliases.items()):
            raise bad_request("receive_target.aliases must map names to names", "kwargs.receive_target")
        try:
            if not self.hf_config:
                raise LoraError(f"Loading lora {name} failed: the model has no config.json to check it against")
            f = adapter_factors(name, conf, self.hf_config, self.cfg.lora.max_lora_rank)
        except LoraError as e:
            raise APIError(str(e), status=400, param="kwargs.receive_target") from None
        old = self.adapters.get(name)
        lora_id = old[0].id if old else self.memory_ids.get(name) or self._new_id()
        self.memory_ids[name] = lora_id
        version = (old[0].version if old else 0) + 1
        self.armed[name] = LoraRef(lora_id, name, MEMORY_PREFIX + name, version)
        return LoraTargetCall(name, lora_id, version, f.rank, f.scaling, aliases, f.experts)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def committed(self) -> None:
        """A weight update committed: the versions it built serve from now on."""
        for name, ref in self.armed.items():
            old = self.adapters.get(name)
            self.adapters[name] = (ref, old[1] if old else self.base_names[0])
            log.info("gateway.lora_pushed", lora_name=name, lora_int_id=ref.id, version=ref.version)
            self.to_push.discard(name)
        self.armed.clear()

    def dropped(self, names: set[str]) -> None:
        """A level-2 sleep dropped these pushed adapters on the workers."""
        self.to_push |= {n for n in names if n in self.adapters and self.adapters[n][0].path.startswith(MEMORY_PREFIX)}

    def aborted(self) -> None:
        self.armed.clear()

    def unload(self, name: str) -> str:
        if not name:
            raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", status=400, type=INVALID)
        if name not in self.adapters:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, type=NOT_FOUND)
        del self.adapters[name]
        self.to_push.discard(name)
        log.info("gateway.lora_unloaded", lora_name=name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def lora_registry(cfg: Any, base_names: list[str], model_root: str) -> LoraRegistry | None:
    """The registry with --enable-lora (the --lora-modules loaded; a bad one stops the start), else None."""
    if not cfg.lora.enable_lora:
        return None
    reg = LoraRegistry(cfg, base_names, model_root)
    for m in parse_lora_modules(cfg.lora.lora_modules):
        try:
            reg.load(m.name, m.path, parent=m.base_model_name)
        except APIError as e:
            raise SystemExit(f"rollbus gateway: --lora-modules {m.name}: {e}") from None
    return reg


LORA_RPC = ("skyrl_set_lora_receive_target", "skyrl_discard_in_memory_lora")


def add_lora_routes(app: FastAPI, reg: LoraRegistry | None, client: Any, timeout_s: float) -> None:
    app.state.lora = reg  # gateway/weight_routes.py: a commit registers the armed versions, an abort drops them
    if reg is None:
        return

    async def lora_rpc(method: str, kwargs: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """/collective_rpc's SkyRL LoRA methods (gateway/dev_routes.py hands them here)."""
        if method == LORA_RPC[0]:
            call = reg.arm(kwargs.get("receive_target"))
        else:
            name = kwargs.get("lora_name")
            if not isinstance(name, str) or not name:
                raise bad_request("kwargs.lora_name must be a non-empty string", "kwargs.lora_name")
            if name not in reg.memory_ids:
                return {"results": [False]}
            call = LoraTargetCall(name, reg.memory_ids[name])
        command = CollectiveRpc(method, call)
        reply = await client.control(command, timeout_s=timeout or timeout_s)
        if not reply.ok:
            reg.aborted()
            raise control_failure(command, reply)
        return {"results": [r.value for n, r in sorted(reply.results.items())
                            if n.startswith("worker") and isinstance(r, ExtensionReturned)]}

    app.state.lora_rpc = lora_rpc

    @app.post("/skyrl/v1/load_lora_adapter")
    async def skyrl_load_lora_adapter(request: Request) -> Response:
        """SkyRL 0.4's route: {lora_name, lora_path} loads (in place) from a folder; {lora_name, in_memory:
        true} confirms the version the last weight update pushed (registered at its commit)."""
        body = await _body(request)
        name, path, in_memory = str(body.get("lora_name") or ""), body.get("lora_path"), bool(body.get("in_memory"))
        if not name or in_memory == bool(path):
            raise APIError("'lora_name' plus exactly one of 'lora_path' or 'in_memory': true must be provided.",
                           status=400, type=INVALID)
        if in_memory:
            ref = reg.ref(name)
            if ref is None or not ref.path.startswith(MEMORY_PREFIX):
                raise APIError(f"Loading lora {name} failed: no weight update pushed it (arm the update with "
                               "skyrl_set_lora_receive_target through /collective_rpc first)", status=400,
                               type=INVALID, param="lora_name")
            return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)
        async with reg.lock:
            text = await asyncio.to_thread(reg.load, name, str(path), True)
        return Response(text, status_code=200)

    if not runtime_updates_allowed():
        return
    log.warning("gateway.lora_runtime_updates", message="LoRA dynamic loading & unloading is enabled in the API "
                "server. This should ONLY be used for local development!")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await _body(request)
        name, path = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
        async with reg.lock:  # the folder check reads files: off the event loop, one load at a time
            text = await asyncio.to_thread(reg.load, name, path, bool(body.get("load_inplace", False)))
        return Response(text, status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _body(request)
        async with reg.lock:
            return Response(reg.unload(str(body.get("lora_name") or "")), status_code=200)



async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError("the body must be a JSON object", status=400) from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object", status=400)
    return body
