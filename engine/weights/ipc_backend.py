"""The ipc backend (config name ipc; alias npu_ipc): the trainer shares memory with the workers on its host
and sends handles to it (engine.weights.ipc: shared memory from a CPU trainer, CUDA/NPU IPC from a device;
vLLM's pickled handles through a restricted unpickler). `Sender` is the trainer client's half, `Receiver` a
worker's.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.weights import backends, ipc, ipc_pickled
from engine.weights.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    ParamMeta,
    UpdateMeta,
    WeightSyncError,
    byte_views,
    pack,
    plan_chunks,
    relocate,
)

_PICKLED = "ipc_handles_pickled"


class Receiver(backends.Receiver):
    """A worker's half: opens the handles of an update (mappings cached across updates), checks every one
    against the declared tensors, then copies out of them."""

    def __init__(self) -> None:
        self.importer = ipc.HandleImporter()

    def check_start(self) -> None:
        self.importer.prune()  # drop mappings of buffers their trainer has closed

    def update(self, info: Any, r: Any) -> tuple[int, int]:
        r.require_active()
        meta = UpdateMeta.parse(info)
        dests = r.validate(meta.params)
        rank = r.rank if r.adopts() else None  # lent bytes may become the staging copies as they are
        try:
            with r.copying():
                sources = self._sources(info, meta, r.device, rank)  # every handle mapped and checked: now write
                r.place([(p.name, src, dst) for p, src, dst in zip(meta.params, sources, dests)],
                        self.importer.lent() if rank is not None else set())
        except WeightSyncError:
            raise
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}", status=500) from None
        r.received += [p.name for p in meta.params]
        return len(meta.params), meta.nbytes

    def _sources(self, info: Any, meta: UpdateMeta, device: torch.device, rank: int | None) -> list[torch.Tensor]:
        handles, param, pickled = info.ipc_handles, "ipc_handles", info.ipc_handles_pickled is not None
        if pickled:
            if handles is not None:
                raise WeightSyncError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`",
                                      param="ipc_handles")
            handles, param = _unpickle(info.ipc_handles_pickled), _PICKLED
        if isinstance(handles, dict):  # packed: one buffer holding every tensor back to back
            sizes = info.tensor_sizes
            if sizes is not None and sizes != [p.nbytes for p in meta.params]:
                raise WeightSyncError("update_info.tensor_sizes does not match names/dtype_names/shapes",
                                      param="tensor_sizes")
            expects = [(handles, ipc_pickled.Expect(torch.uint8, (meta.nbytes,), packed=True), meta.params, param)]
        elif isinstance(handles, list):
            n, m = len(handles), len(meta.params)
            if n != m:
                raise WeightSyncError(f"`ipc_handles` should be of the same size as `names`: got {n} and {m}" if pickled
                                      else f"update_info.ipc_handles has {n} entries for {m} names", param=param)
            expects = [(h, ipc_pickled.Expect(p.dtype, p.shape), [p], f"{param}[{i}]")
                       for i, (h, p) in enumerate(zip(handles, meta.params))]
        else:
            raise WeightSyncError(f"update_info.{_PICKLED} must hold a list (one handle dict per tensor) or one dict "
                                  f"(packed), got {type(handles).__name__}" if pickled else "update_info.ipc_handles "
                                  "must be a list (one handle per tensor) or one handle object (packed)", param=param)
        return [v for h, expect, params, where in expects
                for v in byte_views(self._open(h, expect, params, where, param, device, rank), params)]

    def _open(self, h: Any, expect: ipc_pickled.Expect, params: list[ParamMeta], where: str, param: str,
              device: torch.device, rank: int | None) -> torch.Tensor:
        try:
            if param == _PICKLED:  # vLLM's: checked against the declared tensors, then opened as our own
                names = f" ({params[0].name!r})" if len(params) == 1 and not expect.packed else ""
                h = ipc_pickled.resolve_pickled_handle(h, expect, device, f"update_info.{where}{names}")
                if isinstance(h, torch.Tensor):  # a CPU trainer's inline bytes
                    return h
        except ValueError as e:
            raise WeightSyncError(str(e), param=param) from None
        try:
            buf = self.importer.open(h, device, rank)
        except ValueError as e:
            raise WeightSyncError(f"update_info.{where}: {e}", param="ipc_handles") from None
        if buf.numel() != expect.nbytes:
            raise WeightSyncError(f"update_info.{where} covers {buf.numel()} bytes, the tensors need "
                                  f"{expect.nbytes}", param="ipc_handles")
        return buf

    def shutdown(self) -> None:
        self.importer.close()


def _unpickle(text: Any) -> Any:
    """vLLM's ``ipc_handles_pickled``, behind vLLM's opt-in; read by the restricted unpickler."""
    try:
        if not ipc_pickled.insecure_serialization_allowed():
            raise WeightSyncError(
                f"Refusing to deserialize `ipc_handles_pickled` without {ipc_pickled.INSECURE_SERIALIZATION_VAR}=1: "
                "set it in the environment of `rollbus serve` (vLLM's opt-in; rollbus then admits only torch's "
                "tensor-rebuild arguments, see docs/weight-sync.md), or send plain-data `ipc_handles` "
                "(engine.trainer.WeightSyncClient does)", param=_PICKLED)
        return ipc_pickled.load_pickled_handles(text)
    except ValueError as e:
        raise WeightSyncError(str(e), param=_PICKLED) from None


class Sender(backends.Sender):
    """The trainer's half. CPU: tensors are copied into lent shared-memory segments (engine.weights.ipc), a
    chunk each, while the engine takes the previous chunk: a worker keeps lent bytes as its staging copies,
    so each byte is copied once; a segment is written again once no worker holds it (at steady state the
    engine serves from one update's segments while the next is written into the other's). With
    share_memory the trainer's own tensors move into one shared segment, so nothing is copied on this side
    (the engine copies out). CUDA/NPU: handles to the tensors' own device memory (unpacked) or to one
    staging buffer per chunk (packed). Handles are plain data."""

    ONE_ENGINE = True  # a fleet (several engines, one update) needs a collective
    SHARE_MEMORY_PACKED = False  # share_memory: unpacked handles into the trainer's own (shared) memory

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._buffers: list[Any] = []  # _DeviceBuffer per slot, reused across versions
        self._lent: list[ipc.SharedBuffer] = []  # CPU: lent segments, written again once no worker holds them
        self._arena: ipc.SharedBuffer | None = None  # share_memory: the segment holding the trainer's tensors

    def init_transfer(self) -> None:
        self.c._post("/init_weight_transfer_engine", {"init_info": {"packed": self.c.packed}})

    def prepare(self, named: Any) -> Any:
        return self._share(list(named)) if self.c.share_memory and not self.c.packed else named

    def transfer(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """Fill buffer k+1 while the engine copies out of buffer k."""
        with ThreadPoolExecutor(1) as pool:  # one engine call at a time, in order
            inflight: list[Future | None] = [None] * self.c.num_buffers
            for k, info in enumerate(self.updates(tensors, metas, reuse=inflight)):
                inflight[k % self.c.num_buffers] = pool.submit(self.c._post, "/update_weights", {"update_info": info})
            for f in inflight:
                if f is not None:
                    f.result()

    def bus_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> list[dict]:
        return list(self.updates(tensors, metas, reuse=None))

    def updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta],
                reuse: list[Future | None] | None):
        """Yield each update_info after staging its chunk. `reuse` holds the engine call that still reads each
        buffer: wait for it before overwriting (None: every chunk gets its own buffer)."""
        c, device = self.c, tensors[0][1].device
        if not c.packed and (device.type != "cpu" or self._in_arena([t for _, t in tensors])):
            # handles to the tensors' own memory: nothing is copied on this side
            handles = [self._arena.handle(self._arena_offset(t), m.nbytes) if device.type == "cpu"
                       else ipc.export_handle(t) for (_, t), m in zip(tensors, metas)]
            yield {**UpdateMeta(metas).to_info(), "ipc_handles": handles}
            return
        # a shared buffer must hold the largest tensor (vLLM's examples size it the same way)
        size = max(c.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES // 4, max(m.nbytes for m in metas))
        chunks = plan_chunks(metas, size, fit=True)
        nbuf = len(chunks) if reuse is None else min(c.num_buffers, len(chunks))
        used: list[ipc.SharedBuffer] = []
        for k, chunk in enumerate(chunks):
            slot = k % nbuf
            if reuse is not None and reuse[slot] is not None:
                reuse[slot].result()  # the engine is done with this buffer
            nbytes = sum(metas[i].nbytes for i in chunk)
            buf = self._segment(nbytes, used) if device.type == "cpu" else self._buffer(slot, nbytes, device)
            offsets = pack(buf.tensor, [tensors[i][1] for i in chunk])
            sub = UpdateMeta([metas[i] for i in chunk]).to_info()
            if c.packed:
                yield {**sub, "ipc_handles": buf.handle(0, nbytes), "tensor_sizes": [n for _, n in offsets]}
            else:
                yield {**sub, "ipc_handles": [buf.handle(o, n) for o, n in offsets]}
        # beyond two updates' worth (one the engine serves from, one to write next), free segments left over
        # from another plan go
        spare = sum(b.size for b in self._lent) - 2 * sum(b.size for b in used)
        for b in [b for b in self._lent if b not in used and not b.held()]:
            if spare < b.size:
                continue
            spare -= b.size
            self._lent.remove(b)
            b.close()

    def _segment(self, nbytes: int, used: list[ipc.SharedBuffer]) -> ipc.SharedBuffer:
        """The smallest lent segment of >= nbytes that no worker holds and this update has not taken, else a
        new one and its twin, for the next update (made now, with the first update's cold cost)."""
        free = [b for b in self._lent if b.size >= nbytes and b not in used and not b.held()]
        b = min(free, key=lambda b: b.size) if free else None
        if b is None:
            b, twin = ipc.SharedBuffer(nbytes, lend=True), ipc.SharedBuffer(nbytes, lend=True)
            self._lent += [b, twin]
            used.append(twin)  # not for this update
        used.append(b)
        return b

    def _share(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """share_memory: move the trainer's own tensors into one shared-memory segment (once; again only if
        some tensor left it), re-pointing each tensor's .data, so sends copy nothing on this side (the engine
        reads the trainer's memory, as CUDA IPC does). Parameters keep their identity (optimizers hold the
        same objects). Tensors that cannot be shared as they are (another dtype than the engine's,
        non-contiguous, on a device) leave everything on the staging path."""
        dtype, ts = self.c._dtype(), [t for _, t in named]
        if self._in_arena(ts) or any(t.device.type != "cpu" or not t.is_contiguous()
                                     or (dtype is not None and t.dtype != dtype) for t in ts):
            return named
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in ts]  # 64-byte aligned slots
        arena = ipc.SharedBuffer(sum(sizes))
        relocate(ts, arena.tensor, list(itertools.accumulate(sizes, initial=0))[:-1])
        if self._arena is not None:
            self._arena.close()  # tensors still viewing it keep its memory
        self._arena = arena
        return named

    def _in_arena(self, ts: list[torch.Tensor]) -> bool:
        return self._arena is not None and all(self._arena_offset(t) is not None for t in ts)

    def _arena_offset(self, t: torch.Tensor) -> int | None:
        off = t.data_ptr() - self._arena.tensor.data_ptr()
        return off if 0 <= off and off + t.numel() * t.element_size() <= self._arena.size else None

    def _buffer(self, slot: int, nbytes: int, device: torch.device) -> Any:
        self._buffers += [None] * (slot + 1 - len(self._buffers))
        b = self._buffers[slot]
        if b is None or b.size < nbytes:
            if b is not None:
                b.close()
            b = self._buffers[slot] = _DeviceBuffer(nbytes, device)
        return b

    def close(self) -> None:
        for b in self._buffers + self._lent:
            b.close()  # a lent segment a worker holds stays its memory until it lets go
        self._buffers, self._lent = [], []
        if self._arena is not None:
            self._arena.close()  # unlinks the name; the trainer's tensors keep the memory
            self._arena = None


class _DeviceBuffer:
    """A staging buffer in accelerator memory for packed IPC; handles point into it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.size = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def handle(self, offset: int, nbytes: int) -> dict[str, Any]:
        return ipc.export_handle(self.tensor[offset:offset + nbytes])

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
