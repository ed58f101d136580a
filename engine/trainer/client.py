"""The trainer's side of weight sync: push a model's weights into a running rollbus engine.

    from engine.trainer import WeightSyncClient

    client = WeightSyncClient("http://127.0.0.1:8000", backend="ipc")      # or backend="hccl"
    client.send_weights(model.named_parameters(), version="step-7", pause="keep")
    client.close()

send_weights does pause -> start -> transfer -> finish (with the version) -> resume over the engine's
HTTP endpoints (vLLM v0.33's), or, with bus="tcp://HOST:PORT_BASE", announces the version on the bus as
one WeightUpdateEvent and the coordinator drives the same steps (a tcp bus needs the engine's client
keys: bus_curve_dir= or env ROLLBUS_BUS_CURVE_DIR, see bus.auth). Any failure raises WeightSyncFailed with
the server's message; the engine then keeps the previous weights.

Transfers:
  ipc  CPU: tensors are copied into shared-memory buffers (reused across versions) and the engine copies
       them out; CUDA/NPU: handles to the tensors' own device memory (unpacked) or to one staging buffer
       per chunk (packed). Handles are plain data: no pickle.
  hccl one broadcast per tensor, or per packed chunk (packed=True), from this process as rank 0 of a group
       of its own (it does not touch a default process group the trainer may have), run while the engine's
       update_weights call receives them. The group is vLLM's: a StatelessProcessGroup rendezvous, then
       NCCL/HCCL as vLLM's PyNccl/PyHccl communicators (Gloo on CPU), vLLM's init_info/update_info fields
       and packed chunking (ascend_ops/collective.py); a vLLM trainer and this client are interchangeable.

Importable without a running engine and without the server's modules (only the wire protocol).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.weight_transfer_config import BACKENDS
from engine.weight_update import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DTYPES,
    ParamMeta,
    UpdateMeta,
    plan_chunks,
    tensor_checksum,
)

PAUSE_MODES = ("abort", "wait", "keep")


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
    def __init__(self, base_url: str | None = "http://127.0.0.1:8000", backend: str = "ipc", *, packed: bool = True,
                 bus: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 packed_buffer_size_bytes: int | None = None, packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
                 master_address: str = "127.0.0.1", master_port: int | None = None, clear_cache: bool = True,
                 device: torch.device | str | None = None, share_memory: bool = False,
                 bus_curve_dir: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if base_url is None and bus is None:
            raise ValueError("give base_url (HTTP) or bus (tcp://HOST:PORT_BASE or ipc:///FOLDER)")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.backend = BACKENDS[backend]
        self.packed, self.api_key, self.timeout_s = packed, api_key, timeout_s
        self.buffer_size = packed_buffer_size_bytes
        self.num_buffers = max(1, packed_num_buffers)
        self.master_address, self.master_port = master_address, master_port
        self.clear_cache = clear_cache
        self.device = torch.device(device) if device is not None else None
        self.group = None  # ascend_ops.collective.WeightGroup (hccl)
        self._buffers: list[Any] = []  # ascend_ops.ipc.SharedBuffer, reused across versions (ipc on CPU)
        self._pack_bufs: list[torch.Tensor] = []  # packed broadcast chunks, reused across versions (hccl)
        # ipc on CPU, unpacked: the trainer's tensors moved into one shared segment, sent without a copy
        self.share_memory = share_memory
        self._arena = None
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
        if self.share_memory and self.backend == "ipc" and not self.packed:
            named_tensors = self._share(list(named_tensors))
        tensors = self._prepare(named_tensors)
        metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        self.timings = {"prepare": time.perf_counter() - t0}
        if self.backend == "hccl" and self.group is None:
            self.init_transfer()
        if self._bus is not None:
            self._send_bus(tensors, metas, version, pause)
        else:
            self._send_http(tensors, metas, version, pause)
        self.timings["total"] = time.perf_counter() - t0
        return self.timings

    def init_transfer(self) -> None:
        """hccl: form the group (this process is rank 0) while the engine's workers join it."""
        from ascend_ops.collective import WeightGroup

        if self.backend != "hccl":
            self._post("/init_weight_transfer_engine", {"init_info": {"packed": self.packed}})
            return
        world = int(self._get("/get_world_size")["world_size"]) + 1 if self.base_url else self._bus_world()
        port = self.master_port or _free_port()
        info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1, "world_size": world,
                "packed": self.packed, "timeout_s": self.timeout_s}
        if self.buffer_size:
            info["packed_buffer_size_bytes"] = self.buffer_size
        info["packed_num_buffers"] = self.num_buffers
        failure: list[BaseException] = []
        engine_side = threading.Thread(target=_capture(failure, lambda: self._control(
            "/init_weight_transfer_engine", {"init_info": info}, self.timeout_s)), daemon=True)
        engine_side.start()
        try:
            self.group = WeightGroup.create(self.master_address, port, 0, world, self.timeout_s,
                                            self.device or torch.device("cpu"), op_timeout_s=self.timeout_s)
        finally:
            engine_side.join(self.timeout_s + 30)
        if failure:
            if self.group is not None:
                self.group.destroy()
                self.group = None
            raise failure[0]

    def close(self) -> None:
        """Tear down the group and the shared buffers (the engine keeps serving the last version)."""
        if self.group is not None:
            try:
                self._control("/shutdown_weight_transfer_engine", {}, 30)
            except (WeightSyncFailed, OSError):
                pass
            self.group.destroy()
            self.group = None
        for b in self._buffers:
            b.close()
        self._buffers, self._pack_bufs = [], []
        if self._arena is not None:
            self._arena.close()  # unlinks the name; the trainer's tensors keep the memory
            self._arena = None
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
        t = time.perf_counter()
        if pause:
            self._post(f"/pause?mode={pause}&clear_cache={str(self.clear_cache).lower()}", None)
        self._mark("pause", t)
        try:  # from here on the engine is resumed whatever happens
            t = time.perf_counter()
            self._start()
            self._mark("start", t)
            t = time.perf_counter()
            if self.backend == "hccl":
                self._transfer_collective(tensors, metas, lambda info: self._post("/update_weights",
                                                                                   {"update_info": info}))
            else:
                self._transfer_ipc(tensors, metas)
            self._mark("transfer", t)
            t = time.perf_counter()
            self._post("/finish_weight_update", {"weight_version": version} if version else None)
            self._mark("finish", t)
        finally:
            if pause:
                t = time.perf_counter()
                self._post("/resume", None)
                self._mark("resume", t)

    def _start(self) -> None:
        try:
            self._post("/start_weight_update", None)
        except WeightSyncFailed as e:
            # the engine slept with sleep_mode_extra_cleanup and released our group: form it again
            if not (self.backend == "hccl" and e.status == 409 and e.param == "init_info"):
                raise
            self.group.destroy()
            self.group = None
            self.init_transfer()
            self._post("/start_weight_update", None)

    def _transfer_ipc(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """Fill buffer k+1 while the engine copies out of buffer k (packed), or one call for all."""
        with ThreadPoolExecutor(1) as pool:  # one engine call at a time, in order
            inflight: list[Future | None] = [None] * self.num_buffers
            for k, (info, _) in enumerate(self._ipc_updates(tensors, metas, reuse=inflight)):
                inflight[k % self.num_buffers] = pool.submit(self._post, "/update_weights", {"update_info": info})
            for f in inflight:
                if f is not None:
                    f.result()

    def _ipc_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                     reuse: list[Future | None] | None):
        """Yield (update_info, chunk) after staging each chunk. `reuse` holds the engine call that still
        reads each buffer: wait for it before overwriting (None: every chunk gets its own buffer)."""
        from ascend_ops import ipc

        on_device = tensors[0][1].device.type != "cpu"
        if not self.packed:
            if on_device:  # handles to the tensors' own memory: nothing is copied on this side
                handles = [ipc.export_handle(t) for _, t in tensors]
                yield {**UpdateMeta(metas).to_info(), "ipc_handles": handles}, list(range(len(metas)))
                return
            if self._arena is not None and all(self._arena_offset(t) is not None for _, t in tensors):
                handles = [self._arena.handle(self._arena_offset(t), m.nbytes) for (_, t), m in zip(tensors, metas)]
                yield {**UpdateMeta(metas).to_info(), "ipc_handles": handles}, list(range(len(metas)))
                return
            chunks = [list(range(len(metas)))]
        else:
            # a shared buffer must hold the largest tensor (vLLM's examples size it the same way)
            size = max(self.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES // 4, max(m.nbytes for m in metas))
            chunks = plan_chunks(metas, size, fit=True)
        nbuf = len(chunks) if reuse is None else min(self.num_buffers, len(chunks))
        for k, chunk in enumerate(chunks):
            slot = k % nbuf
            if reuse is not None and reuse[slot] is not None:
                reuse[slot].result()  # the engine is done with this buffer
            nbytes = sum(metas[i].nbytes for i in chunk)
            buf = self._buffer(slot, nbytes, tensors[0][1].device)
            offsets = _pack(buf.tensor, [tensors[i][1] for i in chunk])
            sub = UpdateMeta([metas[i] for i in chunk]).to_info()
            if self.packed:
                info = {**sub, "ipc_handles": buf.handle(0, nbytes), "tensor_sizes": [n for _, n in offsets]}
            else:
                info = {**sub, "ipc_handles": [buf.handle(o, n) for o, n in offsets]}
            yield info, chunk

    def _share(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """share_memory: move the trainer's own tensors into one shared-memory segment (once; again only
        if some tensor left it), re-pointing each tensor's .data, so sends need no copy on this side: the
        engine reads the trainer's memory, as CUDA IPC does. Parameters keep their identity (optimizers
        hold the same objects). Tensors that cannot be shared as they are (other dtype than the engine's,
        non-contiguous, on a device) leave everything on the staging path."""
        from ascend_ops import ipc

        dtype = self._dtype()
        ts = [t for _, t in named]
        if any(t.device.type != "cpu" or not t.is_contiguous() or (dtype is not None and t.dtype != dtype)
               for t in ts):
            return named
        if self._arena is not None and all(self._arena_offset(t) is not None for t in ts):
            return named
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in ts]  # 64-byte aligned slots
        arena = ipc.SharedBuffer(sum(sizes))
        off = 0
        with torch.no_grad():
            for t, n in zip(ts, sizes):
                nb = t.numel() * t.element_size()
                view = arena.tensor[off:off + nb].view(t.dtype).view(t.shape)
                view.copy_(t)
                t.data = view
                off += n
        if self._arena is not None:
            self._arena.close()  # tensors still viewing it keep its memory
        self._arena = arena
        return named

    def _arena_offset(self, t: torch.Tensor) -> int | None:
        base = self._arena.tensor.data_ptr()
        off = t.data_ptr() - base
        return off if 0 <= off and off + t.numel() * t.element_size() <= self._arena.size else None

    def _buffer(self, slot: int, nbytes: int, device: torch.device):
        from ascend_ops import ipc

        while len(self._buffers) <= slot:
            self._buffers.append(None)
        b = self._buffers[slot]
        if b is None or b.size < nbytes:
            if b is not None:
                b.close()
            b = self._buffers[slot] = (ipc.SharedBuffer(nbytes) if device.type == "cpu"
                                       else _DeviceBuffer(nbytes, device))
        return b

    def _transfer_collective(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                             update_call) -> None:
        """The engine's update_weights call (on a thread) receives what this thread broadcasts."""
        info = UpdateMeta(metas).to_info()  # vLLM's NCCLWeightTransferUpdateInfo: packing was set at init
        failure: list[BaseException] = []
        engine_side = threading.Thread(target=_capture(failure, lambda: update_call(info)), daemon=True)
        engine_side.start()
        try:
            # The engine takes part in every broadcast, even of an update it refuses, and answers after the
            # last one; an answer before that means it receives nothing (say, a 409), so stop sending.
            if not self.packed:
                for _, t in tensors:
                    if failure:
                        break
                    self.group.broadcast(t, 0)
            else:
                self._broadcast_packed(tensors, metas, stop=lambda: bool(failure))
        except Exception as e:
            engine_side.join(self.timeout_s)
            raise WeightSyncFailed(f"broadcast failed: {e}; engine: {failure[0] if failure else 'no error'}") from e
        engine_side.join(self.timeout_s + 30)
        if failure:
            raise failure[0]

    def _broadcast_packed(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                          stop=lambda: False) -> None:
        """vLLM's packed producer: chunks closed once they exceed the buffer size, num_buffers in flight."""
        size = self.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES
        chunks = plan_chunks(metas, size)
        widest = max(sum(metas[i].nbytes for i in c) for c in chunks)
        n = min(self.num_buffers, len(chunks))
        if len(self._pack_bufs) < n or any(b.numel() < widest for b in self._pack_bufs[:n]):
            self._pack_bufs = [torch.empty(widest, dtype=torch.uint8, device=tensors[0][1].device) for _ in range(n)]
        inflight: list[Any] = []
        for k, chunk in enumerate(chunks):
            if stop():
                break
            if len(inflight) >= n:
                inflight.pop(0).wait()  # its buffer is free again
            buf = self._pack_bufs[k % n][:sum(metas[i].nbytes for i in chunk)]
            _pack(buf, [tensors[i][1] for i in chunk])
            inflight.append(self.group.broadcast_async(buf, 0))
        for w in inflight:
            w.wait()

    # --- bus path -----------------------------------------------------------------------------------

    def _send_bus(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                  version: str | None, pause: str | None) -> None:
        from bus.messages import WeightUpdateEvent, WeightUpdateResult

        rid = uuid.uuid4().hex
        if self.backend == "ipc":
            t = time.perf_counter()
            updates = [info for info, _ in self._ipc_updates(tensors, metas, reuse=None)]
            self._mark("stage", t)
        else:
            updates = [{**UpdateMeta(metas).to_info(), "packed": self.packed,
                        **({"packed_buffer_size_bytes": self.buffer_size} if self.buffer_size else {})}]
        ev = WeightUpdateEvent(rid, version or "", pause or "none", self.clear_cache, updates, self.timeout_s)
        t = time.perf_counter()
        if self.backend == "hccl":
            from bus.sockets import send

            send(self._bus.sock, ev)  # the coordinator pauses and starts; the workers then receive
            if self.packed:
                self._broadcast_packed(tensors, metas)
            else:
                for _, tensor in tensors:
                    self.group.broadcast(tensor, 0)
            reply = self._bus.wait(rid, WeightUpdateResult, self.timeout_s + 60, "weight update")
        else:
            reply = self._bus.call(ev, WeightUpdateResult, self.timeout_s + 60)
        self._mark("sync", t)
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

    def _control(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        """POST path with body, or over the bus the command of that name with body as its fields."""
        if self.base_url:
            return self._post(path, body)
        from bus.messages import InitWeightTransferEngine, ShutdownWeightTransferEngine

        command = path.removeprefix("/")
        typ = {"init_weight_transfer_engine": InitWeightTransferEngine,
               "shutdown_weight_transfer_engine": ShutdownWeightTransferEngine}[command]
        reply = self._bus.request(typ(**body), timeout_s)
        if not reply.ok:
            raise WeightSyncFailed(f"{command} failed: {reply.error}")
        return reply.results

    def _mark(self, phase: str, t: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - t

    def _get(self, path: str) -> dict[str, Any]:
        return self._http("GET", path, None)

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        return self._http("POST", path, body)

    def _http(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + 60) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
                msg, param = err["message"], err.get("param")
            except (ValueError, KeyError, TypeError, AttributeError):
                msg, param = raw.decode(errors="replace"), None
            raise WeightSyncFailed(f"{method} {path} -> {e.code}: {msg}", e.code, param) from None
        return json.loads(raw) if raw.strip() else {}


class _DeviceBuffer:
    """A staging buffer in accelerator memory for packed IPC; handles point into it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.size = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def handle(self, offset: int, nbytes: int) -> dict[str, Any]:
        from ascend_ops import ipc

        return ipc.export_handle(self.tensor[offset:offset + nbytes])

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _pack(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Copy tensors back to back into a flat uint8 buffer; returns (offset, nbytes) of each."""
    from ascend_ops.platform import bulk_copy_threads

    out, off = [], 0
    with bulk_copy_threads() as copy:
        for t in tensors:
            n = t.numel() * t.element_size()
            copy(buf[off:off + n], t.reshape(-1).view(torch.uint8))
            out.append((off, n))
            off += n
    return out


def _capture(failure: list[BaseException], fn):
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
