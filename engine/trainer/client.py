"""The trainer's side of weight sync: push a model's weights into a running rollbus engine.

    from engine.trainer import WeightSyncClient

    client = WeightSyncClient("http://127.0.0.1:8000", backend="ipc")      # or backend="hccl"
    client.send_weights(model.named_parameters(), version="step-7", pause="keep")
    client.send_lora("policy", get_peft_model_state_dict(peft_model), adapter_config)   # a LoRA adapter
    client.close()

send_weights does pause -> start -> transfer -> finish (with the version) -> resume over the engine's
HTTP endpoints (vLLM v0.33's), or, with bus="tcp://HOST:PORT_BASE", announces the version on the bus as
one WeightUpdateEvent and the coordinator drives the same steps (a tcp bus needs the engine's client
keys: bus_curve_dir= or env ROLLBUS_BUS_CURVE_DIR, see bus.auth). Any failure raises WeightSyncFailed with
the server's message; the engine then keeps the previous weights.

The bytes move through the backend's Sender (engine.weights.backends: ipc_backend shares memory with the
engine, collective_backend broadcasts from this process as rank 0 of vLLM's group); a vLLM trainer and this
client are interchangeable (docs/architecture.md, "Weight sync").

Several engines: WeightSyncClient([url1, url2, ...], backend="hccl") updates them all with one call: one
collective group spans every engine's workers (vLLM's rank layout, engine.trainer.fleet), so one broadcast
feeds all of them; pause -> start -> transfer -> finish -> resume run on every engine, and the finish is
two-phase: every engine verifies its part without committing (/finish_weight_update {"commit": false}),
then every engine commits (/commit_weight_update); a refusal before that aborts every engine
(POST /abort_weight_update) and the error names the engine.

Importable without a running engine and without the server's modules (only the wire protocol).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from engine.trainer.fleet import (
    PREFLIGHT_TIMEOUT_S,
    FleetError,
    check_versions,
    commit_failure,
    engine_urls,
    fan_out,
    fan_out_settled,
    verify_body,
)
from engine.weights import backends
from engine.weights.config import BACKENDS
from engine.weights.lifecycle import PAUSE_MODES
from engine.weights.protocol import (
    CLIENT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DTYPES,
    ParamMeta,
    tensor_checksum,
)
from engine.weights.wire import decode


class WeightSyncFailed(RuntimeError):
    def __init__(self, message: str, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param  # the field the engine's error names ("init_info": initialise the transfer first)


def weight_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                     ) -> dict[str, str]:
    """sha256 per tensor, as the engine's /weight_checker computes it (after casting to `dtype`)."""
    return {n: tensor_checksum(t.detach().to(dtype) if dtype is not None else t) for n, t in named_tensors}


class WeightSyncClient:
    def __init__(self, base_url: str | list[str] | None = "http://127.0.0.1:8000", backend: str = "ipc", *,
                 packed: bool = True, bus: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 packed_buffer_size_bytes: int | None = None, packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
                 master_address: str = "127.0.0.1", master_port: int | None = None, clear_cache: bool = True,
                 device: torch.device | str | None = None, share_memory: bool = False,
                 bus_curve_dir: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if base_url is None and bus is None:
            raise ValueError("give base_url (HTTP) or bus (tcp://HOST:PORT_BASE or ipc:///FOLDER)")
        self.urls = engine_urls(base_url)  # several: one update reaches every engine
        self.base_url = self.urls[0] if self.urls else None
        self.backend = BACKENDS[backend]
        self.sender = backends.sender(self.backend, self)  # the backend's trainer half
        if self.fleet and self.sender.ONE_ENGINE:
            raise FleetError(f"backend {backend} shares memory with one engine on this device; several engines "
                             "take a collective backend (hccl, nccl or gloo)")
        if self.fleet and bus is not None:
            raise FleetError("bus= announces an update to one engine; give several engines as HTTP URLs")
        self.packed, self.api_key, self.timeout_s = packed, api_key, timeout_s
        self.buffer_size = packed_buffer_size_bytes or CLIENT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = max(1, packed_num_buffers)
        self.master_address, self.master_port = master_address, master_port
        self.clear_cache = clear_cache
        self.device = torch.device(device) if device is not None else None
        # the trainer's tensors moved once into memory the transfer reads as it is: one shared segment (ipc,
        # unpacked) or one buffer in packed order (collective, packed)
        if share_memory and packed != self.sender.SHARE_MEMORY_PACKED:
            raise ValueError(f"share_memory=True works with packed={self.sender.SHARE_MEMORY_PACKED} on backend "
                             f"{backend!r} (got packed={packed})")
        self.share_memory = share_memory
        self._engine_dtype: torch.dtype | None = None
        self._bus = None
        if bus is not None:
            from bus.control_client import ControlClient
            from bus.endpoints import Endpoints

            self._bus = ControlClient(Endpoints.from_url(bus, curve_dir=bus_curve_dir),
                                      name=f"trainer-{uuid.uuid4().hex[:8]}")
        self.timings: dict[str, float] = {}  # of the last send_weights, per phase (seconds)

    # --- public -------------------------------------------------------------------------------------

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None,
                     pause: str | None = "keep") -> dict[str, float]:
        """Push every tensor; returns the phase timings. Raises WeightSyncFailed on any failure."""
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"pause must be one of {PAUSE_MODES} or None, got {pause!r}")
        t0 = time.perf_counter()
        if self.fleet:
            self._preflight()
        tensors = self._prepare(self.sender.prepare(named_tensors))
        metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        self.timings = {"prepare": time.perf_counter() - t0}
        self.sender.ensure_ready()
        if self._bus is not None:
            self._send_bus(tensors, metas, version, pause)
        else:
            self._send_http(tensors, metas, version, pause)
        self.timings["total"] = time.perf_counter() - t0
        return self.timings

    def send_lora(self, lora_name: str, named_tensors: Iterable[tuple[str, torch.Tensor]],
                  adapter_config: dict[str, Any], version: str | None = None,
                  pause: str | None = None) -> dict[str, float]:
        """Push a LoRA adapter (its PEFT tensors: `get_peft_model_state_dict(model)`, and its adapter_config
        as a dict) as the next version of `lora_name`, through the same transfer as send_weights: every
        engine's workers are armed for it first (SkyRL's skyrl_set_lora_receive_target), then the update runs
        (all or nothing); requests naming `lora_name` run on the new version once it commits, requests already
        running finish on theirs (no pause needed: pause=None). Raises WeightSyncFailed."""
        if self._bus is not None:
            raise ValueError("send_lora runs over HTTP; bus= drives full-model updates only")
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"pause must be one of {PAUSE_MODES} or None, got {pause!r}")
        target = {"kind": "lora", "lora_name": lora_name, "adapter_config": dict(adapter_config), "aliases": {}}
        if not self.fleet:
            return self._push_lora(target, named_tensors, version, pause)
        self._on_all("/collective_rpc", {"method": "skyrl_set_lora_receive_target",
                                         "kwargs": {"receive_target": target}})
        try:
            return self.send_weights(named_tensors, version, pause)
        except BaseException:
            self._abort_all()  # disarm: the next update must not build this adapter
            raise

    def _push_lora(self, target: dict[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
                   version: str | None, pause: str | None) -> dict[str, float]:
        """One engine: the whole update in one call, POST /push_lora_adapter (the engine arms, starts, takes each
        update_info, finishes and commits; any failure aborts it there). A collective backend broadcasts while
        that call runs, as on the bus path."""
        t0 = time.perf_counter()
        tensors = self._prepare(self.sender.prepare(named_tensors))
        metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        self.timings = {"prepare": time.perf_counter() - t0}
        self.sender.ensure_ready()
        with self._phase("pause"):
            if pause:
                self._post(f"/pause?mode={pause}&clear_cache={str(self.clear_cache).lower()}", None)
        try:
            with self._phase("push"):
                body = {"receive_target": target, "updates": self.sender.bus_updates(tensors, metas),
                        **({"weight_version": version} if version else {})}
                with ThreadPoolExecutor(1) as pool:
                    call = pool.submit(self._post, "/push_lora_adapter", body)
                    try:
                        self.sender.after_announce(tensors, metas)  # a collective's broadcasts
                    finally:
                        call.result()
        finally:
            if pause:
                with self._phase("resume"):
                    self._post("/resume", None)
        self.timings["total"] = time.perf_counter() - t0
        return self.timings

    @property
    def fleet(self) -> bool:
        return len(self.urls) > 1

    def init_transfer(self) -> None:
        """/init_weight_transfer_engine (hccl: form the group, this process rank 0, while the workers join)."""
        self.sender.init_transfer()

    def close(self) -> None:
        """Tear down the group and the shared buffers (the engine keeps serving the last version)."""
        self.sender.close()
        if self._bus is not None:
            self._bus.close()
            self._bus = None

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- HTTP path ----------------------------------------------------------------------------------

    def _send_http(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                   version: str | None, pause: str | None) -> None:
        with self._phase("pause"):
            if pause:
                self._on_all(f"/pause?mode={pause}&clear_cache={str(self.clear_cache).lower()}", None)
        try:  # from here on the engines are resumed whatever happens
            try:
                with self._phase("start"):
                    for url in self.urls:  # one at a time: a start refused for a released group re-forms it
                        self._start(url)
                with self._phase("transfer"):
                    self.sender.transfer(tensors, metas)
                t = time.perf_counter()  # "finish" from here
                if self.fleet:  # phase one: every engine verifies its part, none commits yet
                    self._on_all("/finish_weight_update", verify_body(version))
            except BaseException:
                if self.fleet:  # all or nothing: an engine that took its part drops it too
                    self._abort_all()
                raise
            if self.fleet:  # phase two: every engine verified, every engine commits
                self._commit_all(version)
            else:
                self._post("/finish_weight_update", {"weight_version": version} if version else None)
            self.timings["finish"] = time.perf_counter() - t  # a fleet's two phases together
        finally:
            if pause:
                with self._phase("resume"):
                    self._on_all("/resume", None)
        if self.fleet:
            versions = [v.get("weight_version") for v in self._on_all("/weight_info", None, "GET")]
            check_versions(self.urls, versions)

    def _start(self, url: str) -> None:
        try:
            self._post("/start_weight_update", None, url)
        except WeightSyncFailed as e:
            # the engine slept with sleep_mode_extra_cleanup and released our group: the backend forms it again
            if not self.sender.restart(e.status, e.param):
                raise
            self._post("/start_weight_update", None, url)

    def _on_all(self, path: str, body: dict[str, Any] | None, method: str = "POST") -> list[dict[str, Any]]:
        """One step on every engine at once (the first failure raised, naming its engine)."""
        return fan_out(self.urls, lambda url: self._http(method, path, body, url))

    def _commit_all(self, version: str | None) -> None:
        """Every engine verified the update: commit it on each. A commit that fails now (the engine lost a
        process between the phases, or stopped answering) is named with the engines that did commit."""
        def commit(url: str) -> dict[str, Any]:  # each engine keeps the others' URLs for its restart
            body = {"fleet": [u for u in self.urls if u != url], **({"weight_version": version} if version else {})}
            return self._http("POST", "/commit_weight_update", body, url)

        outcomes = fan_out_settled(self.urls, commit)
        failed = [(u, e) for u, e in zip(self.urls, outcomes, strict=True) if isinstance(e, BaseException)]
        if failed:
            done = [u for u, e in zip(self.urls, outcomes, strict=True) if not isinstance(e, BaseException)]
            raise WeightSyncFailed(commit_failure(failed, done, version), getattr(failed[0][1], "status", 500))

    def _abort_all(self) -> None:
        """Every engine drops the update (a no-op where none is active, e.g. one that aborted itself)."""
        for url in self.urls:
            try:
                self._http("POST", "/abort_weight_update", None, url, timeout_s=PREFLIGHT_TIMEOUT_S)
            except (WeightSyncFailed, OSError):
                pass  # the refusal that brought us here is what the trainer needs to hear

    def _preflight(self) -> None:
        """Refuse a fleet before any transfer: every engine answers, and all are on one weight version."""
        def info(url: str) -> dict[str, Any]:
            try:
                return self._http("GET", "/weight_info", None, url, timeout_s=PREFLIGHT_TIMEOUT_S)
            except OSError as e:
                raise FleetError(f"engine {url} does not answer: {getattr(e, 'reason', e)}") from None
        check_versions(self.urls, [i.get("weight_version") for i in fan_out(self.urls, info)])

    def world_sizes(self) -> list[int]:
        """Each engine's workers (/get_world_size): its share of the group's ranks."""
        return [r.get("world_size") for r in self._on_all("/get_world_size", None, "GET")]

    # --- bus path -----------------------------------------------------------------------------------

    def _send_bus(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                  version: str | None, pause: str | None) -> None:
        from bus.messages import WeightUpdateEvent, WeightUpdateResult
        from bus.sockets import send

        rid = uuid.uuid4().hex
        with self._phase("stage"):  # ipc: the bytes are staged here; typed as the coordinator checks them
            cls = backends.update_struct(self.backend)
            updates = [decode(u, cls, "update_info") for u in self.sender.bus_updates(tensors, metas)]
        ev = WeightUpdateEvent(rid, version or "", pause or "none", self.clear_cache, updates, self.timeout_s)
        with self._phase("sync"):
            send(self._bus.sock, ev)  # the coordinator pauses and starts; the workers then receive
            self.sender.after_announce(tensors, metas)  # hccl: the broadcasts
            reply = self._bus.wait(rid, WeightUpdateResult, self.timeout_s + 60, "weight update")
        self.timings.update({f"engine_{k}": v for k, v in reply.timings_s.items()})
        if not reply.ok:
            err = reply.error
            if err is None:
                raise WeightSyncFailed("weight update failed without saying why")
            raise WeightSyncFailed(err.text(), err.status or 500)

    def _bus_world(self) -> int:
        from bus.messages import MemberEntry, Members

        reply = self._bus.request(Members(), 10)
        return 1 + sum(1 for m in reply.results.values() if isinstance(m, MemberEntry) and m.role == "worker")

    # --- plumbing -----------------------------------------------------------------------------------

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Detach, make contiguous, cast to the engine's dtype (asked once); tied weights appear once in
        named_parameters(), which is what the engine expects."""
        dtype = self._dtype()
        out = []
        for name, t in named_tensors:
            t = t.detach()
            if self.device is not None and t.device != self.device:
                t = t.to(self.device)
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            out.append((name, t.contiguous()))
        if not out:
            raise ValueError("no tensors to send")
        return out

    def _dtype(self) -> torch.dtype | None:
        if self._engine_dtype is None and self.base_url:
            workers = self._get("/server_info").get("workers", {})
            dtypes = {w.get("dtype") for w in workers.values()}
            self._engine_dtype = DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None
        return self._engine_dtype

    def _control(self, path: str, body: dict[str, Any], url: str | None = None, timeout_s: float | None = None) -> Any:
        """POST path with body, or over the bus the command of that name (init_info decoded as the edge does)."""
        if self.base_url:
            return self._post(path, body, url)
        from bus.messages import InitWeightTransferEngine, ShutdownWeightTransferEngine

        command = path.removeprefix("/")
        if command == "init_weight_transfer_engine":
            msg = InitWeightTransferEngine(decode(body["init_info"], backends.init_struct(self.backend), "init_info"))
        else:
            msg = ShutdownWeightTransferEngine()
        reply = self._bus.request(msg, timeout_s or self.timeout_s)
        if not reply.ok:
            raise WeightSyncFailed(f"{command} failed: {reply.error}")
        return reply.results

    @contextmanager
    def _phase(self, name: str):
        """Adds the block's time to timings[name] (when it succeeds)."""
        t = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t

    def _get(self, path: str) -> dict[str, Any]:
        return self._http("GET", path, None)

    def _post(self, path: str, body: dict[str, Any] | None, url: str | None = None) -> dict[str, Any]:
        return self._http("POST", path, body, url)

    def _http(self, method: str, path: str, body: dict[str, Any] | None, url: str | None = None,
              timeout_s: float | None = None) -> dict[str, Any]:
        url = url or self.base_url
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s + 60) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
                msg, param = err["message"], err.get("param")
            except (ValueError, KeyError, TypeError, AttributeError):
                msg, param = raw.decode(errors="replace"), None
            where = f"engine {url}: " if self.fleet else ""
            raise WeightSyncFailed(f"{where}{method} {path} -> {e.code}: {msg}", e.code, param) from None
        return json.loads(raw) if raw.strip() else {}
