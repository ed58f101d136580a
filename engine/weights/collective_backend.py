"""The collective backend (config name hccl; aliases nccl, gloo): vLLM's NCCL weight-transfer engine protocol
over a group of the trainer (rank 0) and every worker (engine.weights.collective: NCCL on CUDA, HCCL on NPU,
Gloo on CPU). One broadcast per tensor in its own dtype, or (packed) one uint8 buffer per chunk of
plan_chunks, num_buffers in flight. Both halves: `Sender` (the trainer client's) and `Receiver` (a worker's).
"""

from __future__ import annotations

import itertools
import pickle
import socket
import threading
import weakref
from collections import deque
from typing import Any

import torch

from bus.messages import CollectiveInitInfo, CollectiveUpdateInfo
from engine.weights import backends
from engine.weights.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    ParamMeta,
    UpdateMeta,
    byte_span,
    byte_views,
    pack,
    plan_chunks,
    relocate,
    torch_dtype,
)
from engine.weights.wire import WeightSyncError, nccl_unique_id

IN_FLIGHT = 16  # unpacked: broadcasts issued before the oldest is waited for (one at a time: 1.6x slower)
TORN_DOWN = "the weight-transfer group was torn down"


class Receiver(backends.Receiver):
    """A worker's half: joins the trainer's group at init, takes part in every broadcast of an update."""

    def __init__(self) -> None:
        self.group = None  # engine.weights.collective.WeightGroup
        self.gone = ""  # why there is no group: " (a sleep released it)", " (<TORN_DOWN>: ...)"
        self._recv: list[torch.Tensor] = []  # packed receive buffers, kept between updates (host only)
        self._blocks = _Blocks()  # host, staging on: packed chunks land here and become the staging copies
        self._last: CollectiveUpdateInfo | None = None  # the tensors vLLM 0.33's empty lists stand for

    def init(self, info: CollectiveInitInfo, r: Any) -> None:
        """Join the trainer's group as rank rank_offset + dp_rank x tp + tp_rank (r.rank is that global worker
        index; pp = 1). The edge checked every field (engine.weights.wire)."""
        from engine.weights.collective import StoreCollision, WeightGroup

        my_rank = info.rank_offset + r.rank
        if not 0 < my_rank < info.world_size:
            raise WeightSyncError(f"worker rank {my_rank} (rank_offset {info.rank_offset} + worker {r.rank}) is "
                                  f"outside world_size {info.world_size}; the trainer is rank 0", param="world_size")
        self.shutdown()
        self._last, self.gone = None, ""
        timeout = info.timeout_s or r.cfg.timeout_s
        try:
            if info.nccl_unique_id_b64:
                self.group = WeightGroup.from_unique_id(nccl_unique_id(info.nccl_unique_id_b64), my_rank,
                                                        info.world_size, r.device)
            else:
                self.group = WeightGroup.create(info.master_address, info.master_port, my_rank, info.world_size,
                                                timeout, r.device, op_timeout_s=timeout)
        except TimeoutError as e:
            raise WeightSyncError(str(e), status=504) from None
        except StoreCollision as e:
            raise WeightSyncError(str(e), status=409) from None
        except (ValueError, pickle.UnpicklingError) as e:  # a bad store object (naming its global), a uid off CUDA
            raise WeightSyncError(str(e), status=400) from None
        except (OSError, RuntimeError) as e:  # ConnectionError, an unloadable library, a failed init
            raise WeightSyncError(f"weight-transfer rendezvous failed: {e}", status=502) from None

    def check_start(self) -> None:
        if self.group is None:
            raise WeightSyncError(f"the hccl backend needs /init_weight_transfer_engine before an update{self.gone}",
                                  status=409, param="init_info")

    def update(self, info: CollectiveUpdateInfo, r: Any) -> tuple[int, int]:
        """Receive one update_weights call's broadcasts; never leave the trainer blocked.

        vLLM's trainer (and ours) broadcasts while this call runs, whatever the engine answers. So when the
        update is refused for its content (a 400: unknown name, wrong shape, a dtype that cannot be cast; the
        edge's refusals come through `drain`) or fails while writing, this worker still takes part in every
        broadcast the trainer issues for it and discards the bytes, then answers; the trainer's broadcasts
        complete and it sees the error within seconds. Refusals of state (409: no start_weight_update, no
        group) drain nothing: a trainer only broadcasts after a successful start. When the broadcasts cannot
        be sized, the group is torn down (Gloo peers then fail at once) and must be initialised again.
        """
        r.require_active()
        self.check_start()
        params = self._plan(info)
        packing = self._packing(info, r)
        try:
            if params is None:
                raise WeightSyncError("update_info.names is empty and no earlier update_weights call of this "
                                      "group left metadata to reuse", param="names")
            dests = r.validate(params)
        except WeightSyncError as e:
            raise WeightSyncError(f"{e}{self._discard(params, packing, r)}", param=e.param) from None
        try:
            with r.copying():
                failure = self._receive(params, dests, *packing, r)
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:  # the group itself failed: it cannot be trusted to line up with the trainer
            self._lose_group(f"a broadcast failed ({type(e).__name__}: {e})")
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}; {TORN_DOWN}: initialise it "
                                  "again", status=500) from None
        if failure is not None:
            raise WeightSyncError(f"weight transfer failed: {type(failure).__name__}: {failure} (the rest of the "
                                  "update's broadcasts were received and discarded)", status=500)
        r.received += [p.name for p in params]
        return len(params), sum(p.nbytes for p in params)

    def drain(self, wire: CollectiveUpdateInfo | None, r: Any) -> str:
        """The edge refused this call: take part in its broadcasts as `wire` sizes them."""
        self.check_start()
        return self._discard(self._plan(wire) if wire is not None else None, self._packing(wire, r), r)

    def _plan(self, info: CollectiveUpdateInfo) -> list[ParamMeta] | None:
        """The tensors this call broadcasts (any torch dtype: a refused one is still drained); vLLM 0.33's
        empty lists stand for the last call's. None when they cannot be sized."""
        if not info.names and not info.dtype_names and not info.shapes:
            info = self._last
            if info is None:
                return None
        params = [ParamMeta(n, torch_dtype(d), tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]
        if any(p.dtype is None for p in params):
            return None
        self._last = info
        return params

    @staticmethod
    def _packing(info: CollectiveUpdateInfo | None, r: Any) -> tuple[bool, int, int]:
        """packed, buffer size, buffers: this call's own, else init_info's."""
        own = (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) if info else (None,) * 3
        return tuple(o if o is not None else d for o, d in zip(own, (r.packed, r.buffer_size, r.num_buffers)))

    def _discard(self, params: list[ParamMeta] | None, packing: tuple[bool, int, int], r: Any) -> str:
        """Take part in a refused call's broadcasts and drop the bytes; returns a note for the error."""
        if not params:
            self._lose_group("update_weights metadata could not be read, so its broadcasts could not be received")
            return ("; the broadcasts of this call could not be sized, so the weight-transfer group was torn "
                    "down: initialise it again")
        try:
            self._receive(params, None, *packing, r)
        except Exception as e:
            self._lose_group(f"discarding a refused update failed ({type(e).__name__}: {e})")
            return f"; discarding its broadcasts failed ({type(e).__name__}: {e}), the group was torn down"
        return f"; its {len(params)} tensors were received from the trainer and discarded"

    def _lose_group(self, why: str) -> None:
        if self.group is not None:
            self.group.destroy(abort=True)
            self.group = None
        self.gone = f" ({TORN_DOWN}: {why})"

    def _receive(self, params: list[ParamMeta], dests: list[torch.Tensor] | None, packed: bool, size: int,
                 nbuf: int, r: Any) -> BaseException | None:
        """Take part in every broadcast of one update_weights call, in vLLM's order: one per tensor, or one per
        packed chunk. ``dests`` None: discard everything. A tensor that is ours whole (and a chunk of one such
        tensor) is received straight into its staging copy; anything else into a receive buffer (num_buffers
        of them in flight when packed, one otherwise) and copied out. A failure while writing does not stop
        the receiving: it is returned once every broadcast is done."""
        group, failure, inflight = self.group, None, deque()
        units = plan_chunks(params, size) if packed else [[i] for i in range(len(params))]
        bufs: list[torch.Tensor] = []

        def consume() -> None:
            nonlocal failure
            unit, slot, buf, work = inflight.popleft()
            work.wait()
            if buf is None or dests is None or failure is not None:
                return
            try:
                views = byte_views(buf, [params[i] for i in unit])
                r.place([(params[i].name, src, dests[i]) for i, src in zip(unit, views)],
                        {buf.untyped_storage().data_ptr()} if slot == -1 else set())
                r.copy.flush()  # the buffer takes the next one
            except Exception as e:
                r.copy.discard()
                failure = e

        def busy() -> set[int]:  # the receive buffers that broadcasts in flight still fill
            return {e[1] for e in inflight if e[1] is not None and e[1] >= 0}

        for unit in units:
            p, target = params[unit[0]], None
            if len(unit) == 1 and dests is not None and failure is None:
                try:
                    target = r.target(dests[unit[0]])
                except Exception as e:
                    failure = e
            if target is not None and target.is_contiguous() and target.dtype == p.dtype \
                    and tuple(target.shape) == p.shape:  # the whole tensor is ours: receive in place
                while len(inflight) >= IN_FLIGHT:
                    consume()
                inflight.append((unit, None, None, group.broadcast_async(target.view(-1).view(torch.uint8)
                                                                         if packed else target, 0)))
                continue
            nbytes = sum(params[i].nbytes for i in unit)
            if packed and dests is not None and failure is None and r.adopts() and r.device.type == "cpu":
                # a block of its own, whose whole parameters become their staging copies (no copy out)
                while len(inflight) >= IN_FLIGHT:
                    consume()
                buf = self._blocks.take(nbytes)
                inflight.append((unit, -1, buf, group.broadcast_async(buf, 0)))
                continue
            if not bufs:
                widest = max(sum(params[i].nbytes for i in u) for u in units)
                bufs = self._recv_buffers(min(nbuf, len(units)), widest, r.device) if packed \
                    else [torch.empty(widest, dtype=torch.uint8, device=r.device)]
            while len(inflight) >= IN_FLIGHT or len(busy()) == len(bufs):
                consume()
            slot = min(set(range(len(bufs))) - busy())
            buf = bufs[slot][:nbytes]
            inflight.append((unit, slot, buf, group.broadcast_async(buf if packed else buf.view(p.dtype).view(p.shape),
                                                                    0)))
        while inflight:
            consume()
        self._blocks.twins()
        return failure

    def _recv_buffers(self, n: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """Packed receive buffers. On the host they are kept between updates (n x chunk bytes resident;
        freed by sleep and shutdown): allocating them per update cost a page fault per 4 KiB of every
        chunk. On accelerators the caching allocator makes them cheap, so they live for one update only."""
        if device.type != "cpu":
            return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        if len(self._recv) < n or any(b.numel() < nbytes for b in self._recv[:n]):
            self._recv = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        return self._recv[:n]

    def release(self) -> int:
        freed = sum(t.numel() * t.element_size() for t in self._recv) + self._blocks.release()
        self._recv = []
        return freed

    def release_group(self) -> bool:
        """sleep_mode_extra_cleanup: tear the group down (its communicator buffers go with it). The trainer
        forms a new one with /init_weight_transfer_engine after the wake."""
        had = self.group is not None
        self.shutdown()
        if had:
            self.gone = " (a sleep with sleep_mode_extra_cleanup released the group: initialise it again)"
        return had

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class Sender(backends.Sender):
    """The trainer's half: forms the group (this process is rank 0, a group of its own that does not touch a
    default process group the trainer may have) while the engine's workers join it, then broadcasts while
    the engine's update_weights call receives."""

    ONE_ENGINE = False  # a fleet (several engines, one update) needs a collective
    SHARE_MEMORY_PACKED = True  # share_memory: packed chunks broadcast from the trainer's own memory

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.group = None  # engine.weights.collective.WeightGroup
        self._pack_bufs: list[torch.Tensor] = []  # packed broadcast chunks, reused across versions

    def prepare(self, named: Any) -> Any:
        """share_memory (packed): move the trainer's tensors, once, into one buffer in the order and layout
        that packed chunks have (back to back), so each chunk is broadcast from it without packing. Tensors
        that cannot move as they are (another dtype than the engine's, non-contiguous, on several devices, a
        dtype whose offset would not be aligned) stay where they are and are packed as before."""
        named = list(named)
        ts = [t for _, t in named]
        if not (self.c.share_memory and self.c.packed) or byte_span(ts) is not None:
            return named
        dtype, dev = self.c._dtype(), ts[0].device
        offsets = list(itertools.accumulate((t.numel() * t.element_size() for t in ts), initial=0))
        if any(t.device != dev or not t.is_contiguous() or (dtype is not None and t.dtype != dtype)
               or off % t.element_size() for t, off in zip(ts, offsets)):
            return named
        relocate(ts, torch.empty(offsets[-1], dtype=torch.uint8, device=dev), offsets[:-1])
        return named

    def ensure_ready(self) -> None:
        if self.group is None:
            self.init_transfer()

    def init_transfer(self) -> None:
        from engine.trainer.fleet import rank_offsets
        from engine.weights.collective import WeightGroup

        c = self.c
        # one engine or several: vLLM's layout, engine i's workers from rank_offset_i
        offsets, world = rank_offsets(c.urls, c.world_sizes()) if c.base_url else ([1], c._bus_world())
        port = c.master_port or _free_port()
        info = {"master_address": c.master_address, "master_port": port, "world_size": world, "packed": c.packed,
                "timeout_s": c.timeout_s, "packed_buffer_size_bytes": c.buffer_size,
                "packed_num_buffers": c.num_buffers}
        calls = [lambda u=url, o=off: c._control("/init_weight_transfer_engine",
                                                  {"init_info": {**info, "rank_offset": o}}, u)
                 for url, off in zip(c.urls or [None], offsets)]
        try:
            with _beside(calls, c.timeout_s + 30) as failure:  # the engines join while this process hosts
                try:
                    self.group = WeightGroup.create(c.master_address, port, 0, world, c.timeout_s,
                                                    c.device or torch.device("cpu"), op_timeout_s=c.timeout_s)
                except Exception as e:
                    if failure:  # the group timed out because an engine refused to join: say why (and which)
                        raise failure[0] from e
                    raise
        except BaseException:
            self.close_group()
            raise

    def restart(self, status: int, param: str | None) -> bool:
        """A start refused because the engine released our group (a sleep with sleep_mode_extra_cleanup):
        form it again and say so (the caller retries the start). The engine names the field: a 409 on
        init_info means "initialise the transfer first"."""
        if not (status == 409 and param == "init_info"):
            return False
        self.close_group()
        self.init_transfer()
        return True

    def transfer(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """The engines' update_weights calls (on threads; several engines: one broadcast feeds them all)
        receive what this thread broadcasts."""
        from engine.trainer.client import WeightSyncFailed

        c = self.c
        info = self.bus_updates(tensors, metas)[0]  # packing travels with the call: the client may flip it
        calls = [lambda u=url: c._post("/update_weights", {"update_info": info}, u) for url in c.urls]
        with _beside(calls, c.timeout_s + 30) as failure:
            try:
                # An engine takes part in every broadcast, even of an update it refuses, and answers after the
                # last one; an answer before that means it receives nothing (say, a 409), so stop sending.
                self.broadcast(tensors, metas, stop=lambda: bool(failure))
            except Exception as e:
                raise WeightSyncFailed(f"broadcast failed: {e}; engine: {failure[0] if failure else 'no error'}") \
                    from e

    def bus_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> list[dict]:
        c = self.c
        return [{**UpdateMeta(metas).to_info(), "packed": c.packed, "packed_buffer_size_bytes": c.buffer_size}]

    def after_announce(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """Bus path: the coordinator pauses and starts; the workers then receive what this broadcasts."""
        self.broadcast(tensors, metas)

    def broadcast(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta], stop=lambda: False) -> None:
        """One broadcast per tensor, or vLLM's packed producer: chunks closed once they exceed the buffer
        size, num_buffers in flight."""
        c, pending = self.c, deque()
        if c.packed:
            chunks = plan_chunks(metas, c.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES)
            # a chunk whose tensors lie back to back (one tensor; every chunk with share_memory) is its bytes
            spans = [byte_span([tensors[i][1] for i in ch]) for ch in chunks]
            widest = max((sum(metas[i].nbytes for i in ch) for ch, sp in zip(chunks, spans) if sp is None),
                         default=0)
            n = min(c.num_buffers, len(chunks))
            if widest and (len(self._pack_bufs) < n or any(b.numel() < widest for b in self._pack_bufs[:n])):
                self._pack_bufs = [torch.empty(widest, dtype=torch.uint8, device=tensors[0][1].device)
                                   for _ in range(n)]
        else:
            chunks, n = [[i] for i in range(len(tensors))], IN_FLIGHT
            spans = [t for _, t in tensors]  # each tensor in its own dtype
        for k, chunk in enumerate(chunks):
            if stop():
                break
            if len(pending) >= n:
                pending.popleft().wait()  # its buffer is free again
            buf = spans[k]
            if buf is None:
                buf = self._pack_bufs[k % n][:sum(metas[i].nbytes for i in chunk)]
                pack(buf, [tensors[i][1] for i in chunk])
            pending.append(self.group.broadcast_async(buf, 0))
        for w in pending:
            w.wait()

    def close_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def close(self) -> None:
        from engine.trainer.client import WeightSyncFailed

        if self.group is not None:
            for url in self.c.urls or [None]:
                try:
                    self.c._control("/shutdown_weight_transfer_engine", {}, url, 30)
                except (WeightSyncFailed, OSError):
                    pass
        self.close_group()
        self._pack_bufs = []


class _Blocks:
    """Host receive blocks that come back once no tensor views them: a block whose parameters became staging
    copies (then the weights in service) returns when a later update has replaced every one of them, so at
    steady state one update's blocks serve while the next is received into the other's."""

    def __init__(self) -> None:
        self.free: list[bytearray] = []
        self.made: list[int] = []  # sizes of the blocks made during this update

    def twins(self) -> None:
        """A second set of the blocks this update made, for the next update (made now, with the first
        update's cold cost)."""
        self.free += [bytearray(n) for n in self.made]
        self.made = []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self.free if len(b) >= nbytes]
        if fits:
            block = min(fits, key=len)
            self.free.remove(block)
        else:
            block = bytearray(nbytes)
            self.made.append(nbytes)
        view = memoryview(block)
        weakref.finalize(view, self.free.append, block)  # every tensor over it holds `view`
        return torch.frombuffer(view, dtype=torch.uint8)[:nbytes]

    def release(self) -> int:
        freed, self.free = sum(map(len, self.free)), []
        return freed


class _beside:
    """Runs `calls` on threads while the with-block runs; yields the list their failures land in, joins them
    (each within `join_s`) on the way out and raises the first failure (several: one error naming each)."""

    def __init__(self, calls: list, join_s: float) -> None:
        self.failure: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(call,), daemon=True) for call in calls]
        self.join_s = join_s

    def _run(self, call) -> None:
        try:
            call()
        except BaseException as e:  # re-raised on the caller's thread
            self.failure.append(e)

    def __enter__(self) -> list[BaseException]:
        for th in self.threads:
            th.start()
        return self.failure

    def __exit__(self, *exc: object) -> None:
        from engine.trainer.client import WeightSyncFailed

        for th in self.threads:
            th.join(self.join_s)
        if exc[0] is None and self.failure:
            if len(self.failure) > 1:
                raise WeightSyncFailed("; ".join(map(str, self.failure)), getattr(self.failure[0], "status", 500))
            raise self.failure[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
