"""The ipc backend (config name ipc; alias npu_ipc): the trainer shares memory with the workers on its host
and sends handles to it (engine.weights.ipc: shared memory from a CPU trainer, CUDA/NPU IPC from a device;
vLLM's pickled handles through a restricted unpickler). Both halves: `Sender` (the trainer client's) and
`Receiver` (a worker's).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.weights.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    ParamMeta,
    UpdateMeta,
    WeightSyncError,
    byte_views,
    pack,
    plan_chunks,
)


class Receiver:
    """A worker's half: opens the handles of an update (cached mappings, engine.weights.ipc.HandleImporter),
    checks every one against the declared tensors, then copies out of them."""

    def __init__(self) -> None:
        self.importer = None  # engine.weights.ipc.HandleImporter

    def init(self, info: dict[str, Any], r: Any) -> None:
        from engine.weights.ipc import HandleImporter

        self.importer = self.importer or HandleImporter()

    def check_start(self) -> None:
        from engine.weights.ipc import HandleImporter

        if self.importer is None:
            self.importer = HandleImporter()
        self.importer.prune()  # drop mappings of buffers their trainer has closed

    def update(self, info: dict[str, Any], r: Any) -> dict[str, Any]:
        r.require_active()
        meta = UpdateMeta.parse(info)
        dests = r.validate(meta)
        try:
            with r.copying():
                sources = self._sources(info, meta, r.device)
                # Everything is mapped and checked: now write.
                for p, src, dst in zip(meta.params, sources, dests):
                    r.write(p.name, src, dst)
        except WeightSyncError:
            raise
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}", status=500) from None
        r.received += [p.name for p in meta.params]
        return {"tensors": len(meta.params), "bytes": meta.nbytes}

    def _sources(self, info: dict[str, Any], meta: UpdateMeta, device: torch.device) -> list[torch.Tensor]:
        if info.get("ipc_handles_pickled") is not None:
            handles = self._pickled_handles(info, meta, device)
        else:
            handles = info.get("ipc_handles")
        if isinstance(handles, dict | torch.Tensor):  # packed: one buffer holding every tensor back to back
            sizes = info.get("tensor_sizes")
            if sizes is not None and sizes != [p.nbytes for p in meta.params]:
                raise WeightSyncError("update_info.tensor_sizes does not match names/dtype_names/shapes",
                                      param="tensor_sizes")
            return byte_views(self._open(handles, meta.nbytes, "ipc_handles", device), meta.params)
        if isinstance(handles, list):
            if len(handles) != len(meta.params):
                raise WeightSyncError(f"update_info.ipc_handles has {len(handles)} entries for "
                                      f"{len(meta.params)} names", param="ipc_handles")
            return [byte_views(self._open(h, p.nbytes, f"ipc_handles[{i}]", device), [p])[0]
                    for i, (h, p) in enumerate(zip(handles, meta.params))]
        raise WeightSyncError("update_info.ipc_handles must be a list (one handle per tensor) or one "
                              "handle object (packed)", param="ipc_handles")

    def _pickled_handles(self, info: dict[str, Any], meta: UpdateMeta, device: torch.device) -> Any:
        """vLLM's ``ipc_handles_pickled`` (its HTTP client's form of reduce_tensor's args) -> the handles
        ``_open`` takes, every field checked against the declared tensors; see engine.weights.ipc."""
        from engine.weights import ipc

        where = "update_info.ipc_handles_pickled"
        if info.get("ipc_handles") is not None:
            raise WeightSyncError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`", param="ipc_handles")
        try:
            allowed = ipc.insecure_serialization_allowed()
        except ValueError as e:
            raise WeightSyncError(str(e), param="ipc_handles_pickled") from None
        if not allowed:
            raise WeightSyncError(
                f"Refusing to deserialize `ipc_handles_pickled` without {ipc.INSECURE_SERIALIZATION_VAR}=1: set it "
                "in the environment of `rollbus serve` (vLLM's opt-in; rollbus then admits only torch's "
                "tensor-rebuild arguments, see docs/weight-sync.md), or send plain-data `ipc_handles` "
                "(engine.trainer.WeightSyncClient does)", param="ipc_handles_pickled")
        try:
            obj = ipc.load_pickled_handles(info["ipc_handles_pickled"])
            if isinstance(obj, dict):  # packed: one buffer, the tensors back to back
                return ipc.resolve_pickled_handle(obj, ipc.Expect(torch.uint8, (meta.nbytes,), packed=True),
                                                  device, where)
            if not isinstance(obj, list):
                raise ValueError(f"{where} must hold a list (one handle dict per tensor) or one dict (packed), "
                                 f"got {type(obj).__name__}")
            if len(obj) != len(meta.params):
                raise ValueError(f"`ipc_handles` should be of the same size as `names`: got {len(obj)} and "
                                 f"{len(meta.params)}")
            return [ipc.resolve_pickled_handle(h, ipc.Expect(p.dtype, p.shape), device, f"{where}[{i}] ({p.name!r})")
                    for i, (h, p) in enumerate(zip(obj, meta.params))]
        except ValueError as e:
            raise WeightSyncError(str(e), param="ipc_handles_pickled") from None

    def _open(self, handle: Any, nbytes: int, where: str, device: torch.device) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):  # a CPU trainer's inline bytes (pickled handles), already checked
            return handle
        try:
            buf = self.importer.open(handle, device)  # type: ignore[union-attr]
        except ValueError as e:
            raise WeightSyncError(f"update_info.{where}: {e}", param="ipc_handles") from None
        if buf.numel() != nbytes:
            raise WeightSyncError(f"update_info.{where} covers {buf.numel()} bytes, the tensors need {nbytes}",
                                  param="ipc_handles")
        return buf

    def release(self) -> int:
        return 0

    def release_group(self) -> bool:
        return False

    def shutdown(self) -> None:
        if self.importer is not None:
            self.importer.close()
            self.importer = None


class Sender:
    """The trainer's half. CPU: tensors are copied into shared-memory buffers (reused across versions) and the
    engine copies them out; with share_memory the trainer's own tensors move into one shared segment, so
    nothing is copied on this side. CUDA/NPU: handles to the tensors' own device memory (unpacked) or to one
    staging buffer per chunk (packed). Handles are plain data: no pickle."""

    def __init__(self, client: Any) -> None:
        self.c = client
        self._buffers: list[Any] = []  # engine.weights.ipc.SharedBuffer, reused across versions (CPU)
        self._arena = None  # share_memory: the segment holding the trainer's tensors

    def ensure_ready(self) -> None:
        pass

    def init_transfer(self) -> None:
        self.c._post("/init_weight_transfer_engine", {"init_info": {"packed": self.c.packed}})

    def restart(self, status: int, param: str | None) -> bool:
        return False

    def prepare(self, named: Any) -> Any:
        if self.c.share_memory and not self.c.packed:
            return self._share(list(named))
        return named

    def transfer(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """Fill buffer k+1 while the engine copies out of buffer k (packed), or one call for all."""
        c = self.c
        with ThreadPoolExecutor(1) as pool:  # one engine call at a time, in order
            inflight: list[Future | None] = [None] * c.num_buffers
            for k, info in enumerate(self.updates(tensors, metas, reuse=inflight)):
                inflight[k % c.num_buffers] = pool.submit(c._post, "/update_weights", {"update_info": info})
            for f in inflight:
                if f is not None:
                    f.result()

    def bus_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> list[dict]:
        return list(self.updates(tensors, metas, reuse=None))

    def after_announce(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        pass  # the workers read the staged buffers while the coordinator drives the update

    def updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                reuse: list[Future | None] | None):
        """Yield each update_info after staging its chunk. `reuse` holds the engine call that still reads each
        buffer: wait for it before overwriting (None: every chunk gets its own buffer)."""
        from engine.weights import ipc

        c = self.c
        on_device = tensors[0][1].device.type != "cpu"
        if not c.packed:
            if on_device:  # handles to the tensors' own memory: nothing is copied on this side
                yield {**UpdateMeta(metas).to_info(), "ipc_handles": [ipc.export_handle(t) for _, t in tensors]}
                return
            if self._arena is not None and all(self._arena_offset(t) is not None for _, t in tensors):
                handles = [self._arena.handle(self._arena_offset(t), m.nbytes) for (_, t), m in zip(tensors, metas)]
                yield {**UpdateMeta(metas).to_info(), "ipc_handles": handles}
                return
            chunks = [list(range(len(metas)))]
        else:
            # a shared buffer must hold the largest tensor (vLLM's examples size it the same way)
            size = max(c.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES // 4, max(m.nbytes for m in metas))
            chunks = plan_chunks(metas, size, fit=True)
        nbuf = len(chunks) if reuse is None else min(c.num_buffers, len(chunks))
        for k, chunk in enumerate(chunks):
            slot = k % nbuf
            if reuse is not None and reuse[slot] is not None:
                reuse[slot].result()  # the engine is done with this buffer
            nbytes = sum(metas[i].nbytes for i in chunk)
            buf = self._buffer(slot, nbytes, tensors[0][1].device)
            offsets = pack(buf.tensor, [tensors[i][1] for i in chunk])
            sub = UpdateMeta([metas[i] for i in chunk]).to_info()
            if c.packed:
                yield {**sub, "ipc_handles": buf.handle(0, nbytes), "tensor_sizes": [n for _, n in offsets]}
            else:
                yield {**sub, "ipc_handles": [buf.handle(o, n) for o, n in offsets]}

    def _share(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """share_memory: move the trainer's own tensors into one shared-memory segment (once; again only
        if some tensor left it), re-pointing each tensor's .data, so sends need no copy on this side: the
        engine reads the trainer's memory, as CUDA IPC does. Parameters keep their identity (optimizers
        hold the same objects). Tensors that cannot be shared as they are (other dtype than the engine's,
        non-contiguous, on a device) leave everything on the staging path."""
        from engine.weights import ipc

        dtype = self.c._dtype()
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
        off = t.data_ptr() - self._arena.tensor.data_ptr()
        return off if 0 <= off and off + t.numel() * t.element_size() <= self._arena.size else None

    def _buffer(self, slot: int, nbytes: int, device: torch.device):
        from engine.weights import ipc

        while len(self._buffers) <= slot:
            self._buffers.append(None)
        b = self._buffers[slot]
        if b is None or b.size < nbytes:
            if b is not None:
                b.close()
            b = self._buffers[slot] = (ipc.SharedBuffer(nbytes) if device.type == "cpu"
                                       else _DeviceBuffer(nbytes, device))
        return b

    def close(self) -> None:
        for b in self._buffers:
            b.close()
        self._buffers = []
        if self._arena is not None:
            self._arena.close()  # unlinks the name; the trainer's tensors keep the memory
            self._arena = None


class _DeviceBuffer:
    """A staging buffer in accelerator memory for packed IPC; handles point into it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.size = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def handle(self, offset: int, nbytes: int) -> dict[str, Any]:
        from engine.weights import ipc

        return ipc.export_handle(self.tensor[offset:offset + nbytes])

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
