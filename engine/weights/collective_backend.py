"""The collective backend (config name hccl; aliases nccl, gloo): vLLM's NCCL weight-transfer engine protocol
over a group of the trainer (rank 0) and every worker (engine.weights.collective: NCCL on CUDA, HCCL on NPU,
Gloo on CPU). One broadcast per tensor in its own dtype, or (packed) one uint8 buffer per chunk of
plan_chunks, num_buffers in flight. Both halves: `Sender` (the trainer client's) and `Receiver` (a worker's).
"""

from __future__ import annotations

import base64
import binascii
import pickle
import socket
import threading
from collections import deque
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

IN_FLIGHT = 16  # unpacked: broadcasts issued before the oldest is waited for (the order is every rank's)
# vLLM's NCCLWeightTransferInitInfo fields, plus rollbus's timeout_s
INIT_INFO_KEYS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
                            "packed", "packed_buffer_size_bytes", "packed_num_buffers", "timeout_s"})


class Receiver:
    """A worker's half: joins the trainer's group at init, takes part in every broadcast of an update."""

    def __init__(self) -> None:
        self.group = None  # engine.weights.collective.WeightGroup
        self.group_released = False  # by a sleep with sleep_mode_extra_cleanup
        self._recv: list[torch.Tensor] = []  # packed receive buffers, kept between updates (host only)
        self._last_wire: dict[str, Any] | None = None  # names/dtype_names/shapes vLLM 0.33 may leave out
        self._group_lost: str | None = None  # why the group was torn down behind the trainer

    def init(self, info: dict[str, Any], r: Any) -> None:
        """Join the trainer's group as rank rank_offset + dp_rank x tp + tp_rank (r.rank is that global worker
        index; pp = 1). init_info is vLLM's NCCLWeightTransferInitInfo."""
        from engine.weights.collective import StoreCollision, WeightGroup

        unknown = sorted(set(info) - INIT_INFO_KEYS)
        if unknown:
            raise WeightSyncError(f"init_info: unknown field(s) {unknown}; known: {sorted(INIT_INFO_KEYS)}",
                                  param=unknown[0])
        addr, port, uid_b64 = info.get("master_address"), info.get("master_port"), info.get("nccl_unique_id_b64")
        world, offset = info.get("world_size"), info.get("rank_offset", 1)
        if uid_b64 and (addr is not None or port is not None):
            raise WeightSyncError("init_info: pass nccl_unique_id_b64 OR master_address/master_port, not both",
                                  param="nccl_unique_id_b64")
        if not uid_b64:
            if not isinstance(addr, str) or not addr:
                raise WeightSyncError("init_info.master_address must be a host name or address",
                                      param="master_address")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise WeightSyncError(f"init_info.master_port must be a port number, got {port!r}", param="master_port")
        for fname, v in (("world_size", world), ("rank_offset", offset)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise WeightSyncError(f"init_info.{fname} must be a non-negative integer, got {v!r}", param=fname)
        my_rank = offset + r.rank
        if not 0 < my_rank < world:
            raise WeightSyncError(f"worker rank {my_rank} (rank_offset {offset} + worker {r.rank}) is outside "
                                  f"world_size {world}; the trainer is rank 0", param="world_size")
        timeout = info.get("timeout_s", r.cfg.timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise WeightSyncError(f"init_info.timeout_s must be a positive number, got {timeout!r}", param="timeout_s")
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self._last_wire, self._group_lost = None, None
        try:
            if uid_b64:
                try:
                    uid = base64.b64decode(uid_b64, validate=True)
                except (binascii.Error, ValueError, TypeError):
                    raise WeightSyncError("init_info.nccl_unique_id_b64 is not valid standard base64 (URL-safe "
                                          "base64 is not accepted)", param="nccl_unique_id_b64") from None
                if len(uid) != 128:
                    raise WeightSyncError(f"init_info.nccl_unique_id_b64 must decode to 128 bytes, got {len(uid)}",
                                          param="nccl_unique_id_b64")
                self.group = WeightGroup.from_unique_id(uid, my_rank, world, r.device)
            else:
                self.group = WeightGroup.create(addr, port, my_rank, world, float(timeout), r.device,
                                                op_timeout_s=float(timeout))
        except TimeoutError as e:
            raise WeightSyncError(str(e), status=504) from None
        except StoreCollision as e:
            raise WeightSyncError(str(e), status=409) from None
        except (ValueError, pickle.UnpicklingError) as e:  # a bad store object (naming its global), a uid off CUDA
            raise WeightSyncError(str(e), status=400) from None
        except (OSError, RuntimeError) as e:  # ConnectionError, an unloadable library, a failed init
            raise WeightSyncError(f"weight-transfer rendezvous failed: {e}", status=502) from None
        self.group_released = False

    def check_start(self) -> None:
        if self.group is None:
            why = (" (a sleep with sleep_mode_extra_cleanup released the group: initialise it again)"
                   if self.group_released else f" ({self._group_lost})" if self._group_lost else "")
            raise WeightSyncError(f"the hccl backend needs /init_weight_transfer_engine before an update{why}",
                                  status=409, param="init_info")

    def update(self, info: dict[str, Any], r: Any) -> dict[str, Any]:
        """Receive one update_weights call's broadcasts; never leave the trainer blocked.

        vLLM's trainer (and ours) broadcasts while this call runs, whatever the engine answers. So when the
        update is refused for its content (a 400: unknown name, wrong shape, a dtype that cannot be cast) or
        fails while writing, this worker still takes part in every broadcast the trainer issues for it and
        discards the bytes, then answers; the trainer's broadcasts complete and it sees the error within
        seconds. Refusals of state (409: no start_weight_update, no group) drain nothing: a trainer only
        broadcasts after a successful start. When the metadata is too broken to know what the trainer sends,
        the group is torn down (Gloo peers then fail at once) and must be initialised again.
        """
        if not isinstance(info, dict):
            raise WeightSyncError("update_info must be an object", param="update_info")
        wire, resolved = self._wire_plan(info)
        packed = info.get("packed", r.packed)
        size = info.get("packed_buffer_size_bytes", r.buffer_size)
        nbuf = info.get("packed_num_buffers", r.num_buffers)
        r.require_active()
        if self.group is None:
            raise WeightSyncError("the hccl backend needs /init_weight_transfer_engine before an update"
                                  + (f" ({self._group_lost})" if self._group_lost else ""), status=409)
        try:
            packed = opt_bool(info, "packed", r.packed)
            size = opt_int(info, "packed_buffer_size_bytes", r.buffer_size)
            nbuf = opt_int(info, "packed_num_buffers", r.num_buffers)
            if resolved is None:
                raise WeightSyncError("update_info.names is empty and no earlier update_weights call of this "
                                      "group left metadata to reuse", param="names")
            meta = UpdateMeta.parse(resolved)
            dests = r.validate(meta)
        except WeightSyncError as e:
            if e.status != 400:
                raise
            raise WeightSyncError(f"{e}{self._discard(wire, packed, size, nbuf, r)}", status=400,
                                  param=e.param) from None
        try:
            with r.copying():
                failure = self._receive(meta.params, dests, packed, size, nbuf, r)
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:  # the group itself failed: it cannot be trusted to line up with the trainer
            self._lose_group(f"a broadcast failed ({type(e).__name__}: {e})")
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}; the weight-transfer group "
                                  "was torn down: initialise it again", status=500) from None
        if failure is not None:
            raise WeightSyncError(f"weight transfer failed: {type(failure).__name__}: {failure} (the rest of the "
                                  "update's broadcasts were received and discarded)", status=500)
        r.received += [p.name for p in meta.params]
        return {"tensors": len(meta.params), "bytes": meta.nbytes}

    def _wire_plan(self, info: dict[str, Any]) -> tuple[list[ParamMeta] | None, dict[str, Any] | None]:
        """What the trainer broadcasts for this call, read leniently (any torch dtype name, so a refused dtype
        can still be drained), and the update_info with vLLM 0.33's empty lists replaced by the previous
        call's metadata. (None, ...) when the broadcasts cannot be sized."""
        keys = ("names", "dtype_names", "shapes")
        lists = [info.get(k) for k in keys]
        if all(isinstance(v, list) and not v for v in lists):  # vLLM 0.33: "same parameters as last time"
            if self._last_wire is None:
                return None, None
            info = {**info, **self._last_wire}
            lists = [info[k] for k in keys]
        names, dtypes, shapes = lists
        if not all(isinstance(v, list) for v in lists) or not len(names) == len(dtypes) == len(shapes):
            return None, info
        wire = []
        for name, dt, shape in zip(names, dtypes, shapes):
            dtype = getattr(torch, dt.removeprefix("torch."), None) if isinstance(dt, str) else None
            if (not isinstance(dtype, torch.dtype) or not isinstance(shape, list | tuple)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                return None, info
            wire.append(ParamMeta(str(name), dtype, tuple(shape)))
        if names:
            self._last_wire = {k: info[k] for k in keys}
        return wire, info

    def _discard(self, wire: list[ParamMeta] | None, packed: Any, size: Any, nbuf: Any, r: Any) -> str:
        """Take part in the refused call's broadcasts and drop the bytes; returns a note for the error."""
        if not isinstance(packed, bool):
            packed = r.packed
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            size = r.buffer_size
        if not isinstance(nbuf, int) or isinstance(nbuf, bool) or nbuf <= 0:
            nbuf = r.num_buffers
        if not wire:
            self._lose_group("update_weights metadata could not be read, so its broadcasts could not be received")
            return ("; the broadcasts of this call could not be sized, so the weight-transfer group was torn "
                    "down: initialise it again")
        try:
            self._receive(wire, None, packed, size, nbuf, r)
        except Exception as e:
            self._lose_group(f"discarding a refused update failed ({type(e).__name__}: {e})")
            return f"; discarding its broadcasts failed ({type(e).__name__}: {e}), the group was torn down"
        return f"; its {len(wire)} tensors were received from the trainer and discarded"

    def _lose_group(self, why: str) -> None:
        if self.group is not None:
            self.group.destroy(abort=True)
            self.group = None
        self._group_lost = f"the weight-transfer group was torn down: {why}"

    def _receive(self, params: list[ParamMeta], dests: list[torch.Tensor] | None, packed: bool, size: int,
                 nbuf: int, r: Any) -> BaseException | None:
        """Take part in every broadcast of one update_weights call, in vLLM's order. ``dests`` None: discard
        everything. A failure while writing does not stop the receiving: it is returned once every broadcast
        is done."""
        group = self.group
        failure: BaseException | None = None
        if not packed:
            scratch: torch.Tensor | None = None  # for tensors not received in place (allocated once, lazily)
            inflight: deque = deque()  # in-place receives, IN_FLIGHT at most (one at a time: 1.6x slower)
            for i, p in enumerate(params):
                target = None
                if dests is not None and failure is None:
                    try:
                        target = r.target(dests[i])
                    except Exception as e:
                        failure = e
                if target is not None and target.is_contiguous() and target.dtype == p.dtype \
                        and tuple(target.shape) == p.shape:  # the whole tensor is ours: receive in place
                    if len(inflight) == IN_FLIGHT:
                        inflight.popleft().wait()
                    inflight.append(group.broadcast_async(target, 0))
                    continue
                while inflight:
                    inflight.popleft().wait()
                if scratch is None:
                    scratch = torch.empty(max(q.nbytes for q in params), dtype=torch.uint8, device=r.device)
                buf = scratch[:p.nbytes].view(p.dtype).view(p.shape)
                group.broadcast(buf, 0)
                if target is not None:
                    try:
                        r.copy(target, r.source(p.name, buf))  # casts when the dtypes differ
                        r.copy.flush()  # the scratch buffer takes the next tensor
                    except Exception as e:
                        r.copy.discard()
                        failure = e
            while inflight:
                inflight.popleft().wait()
            return failure
        chunks = plan_chunks(params, size)
        widest = max(sum(params[i].nbytes for i in c) for c in chunks)
        bufs = self._recv_buffers(min(nbuf, len(chunks)), widest, r.device)
        inflight: deque = deque()

        def consume() -> None:
            nonlocal failure
            chunk, buf, work = inflight.popleft()
            work.wait()
            if dests is None or failure is not None:
                return
            try:
                for i, src in zip(chunk, byte_views(buf, [params[i] for i in chunk])):
                    r.write(params[i].name, src, dests[i])
                r.copy.flush()  # the buffer takes another chunk next
            except Exception as e:
                r.copy.discard()
                failure = e

        for ci, chunk in enumerate(chunks):
            if len(inflight) == len(bufs):
                consume()
            buf = bufs[ci % len(bufs)][: sum(params[i].nbytes for i in chunk)]
            inflight.append((chunk, buf, group.broadcast_async(buf, 0)))
        while inflight:
            consume()
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
        freed = sum(t.numel() * t.element_size() for t in self._recv)
        self._recv = []
        return freed

    def release_group(self) -> bool:
        """sleep_mode_extra_cleanup: tear the group down (its communicator buffers go with it). The trainer
        forms a new one with /init_weight_transfer_engine after the wake."""
        if self.group is None:
            return False
        self.group.destroy()
        self.group = None
        self.group_released = True
        return True

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class Sender:
    """The trainer's half: forms the group (this process is rank 0, a group of its own that does not touch a
    default process group the trainer may have) while the engine's workers join it, then broadcasts while
    the engine's update_weights call receives."""

    def __init__(self, client: Any) -> None:
        self.c = client
        self.group = None  # engine.weights.collective.WeightGroup
        self._pack_bufs: list[torch.Tensor] = []  # packed broadcast chunks, reused across versions

    def prepare(self, named: Any) -> Any:
        return named

    def ensure_ready(self) -> None:
        if self.group is None:
            self.init_transfer()

    def init_transfer(self) -> None:
        from engine.trainer.fleet import rank_offsets
        from engine.weights.collective import WeightGroup

        c = self.c
        if c.base_url:  # one engine or several: vLLM's layout, engine i's workers from rank_offset_i
            offsets, world = rank_offsets(c.urls, c.world_sizes())
        else:
            offsets, world = [1], c._bus_world()
        port = c.master_port or _free_port()
        info = {"master_address": c.master_address, "master_port": port, "world_size": world,
                "packed": c.packed, "timeout_s": c.timeout_s}
        if c.buffer_size:
            info["packed_buffer_size_bytes"] = c.buffer_size
        info["packed_num_buffers"] = c.num_buffers
        failure: list[BaseException] = []

        def join(url: str | None, offset: int):
            body = {"init_info": {**info, "rank_offset": offset}}
            if url is None:
                return lambda: c._control("/init_weight_transfer_engine", body, c.timeout_s)
            return lambda: c._post("/init_weight_transfer_engine", body, url)
        engine_side = [threading.Thread(target=capture(failure, join(url, off)), daemon=True)
                       for url, off in zip(c.urls or [None], offsets)]
        for th in engine_side:
            th.start()
        try:
            self.group = WeightGroup.create(c.master_address, port, 0, world, c.timeout_s,
                                            c.device or torch.device("cpu"), op_timeout_s=c.timeout_s)
        except Exception as e:
            if c.fleet and failure:  # the group timed out because an engine refused to join: say which
                raise failure[0] from e
            raise
        finally:
            for th in engine_side:
                th.join(c.timeout_s + 30)
        if failure:
            if self.group is not None:
                self.group.destroy()
                self.group = None
            raise failure[0]

    def restart(self, status: int, param: str | None) -> bool:
        """A start refused because the engine released our group (a sleep with sleep_mode_extra_cleanup):
        form it again and say so (the caller retries the start). The engine names the field: a 409 on
        init_info means "initialise the transfer first"."""
        if not (status == 409 and param == "init_info"):
            return False
        self.group.destroy()
        self.group = None
        self.init_transfer()
        return True

    def transfer(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """The engine's update_weights call (on a thread) receives what this thread broadcasts."""
        from engine.trainer.client import WeightSyncFailed

        c = self.c
        info = self.bus_updates(tensors, metas)[0]  # packing travels with the call: the client may flip it
        failure: list[BaseException] = []
        engine_side = [threading.Thread(target=capture(failure, lambda u=url: c._post(
            "/update_weights", {"update_info": info}, u)), daemon=True) for url in c.urls]
        for th in engine_side:  # several engines: one broadcast feeds them all
            th.start()
        try:
            # An engine takes part in every broadcast, even of an update it refuses, and answers after the
            # last one; an answer before that means it receives nothing (say, a 409), so stop sending.
            self.broadcast(tensors, metas, stop=lambda: bool(failure))
        except Exception as e:
            for th in engine_side:
                th.join(c.timeout_s)
            raise WeightSyncFailed(f"broadcast failed: {e}; engine: {failure[0] if failure else 'no error'}") from e
        for th in engine_side:
            th.join(c.timeout_s + 30)
        if failure:
            if len(failure) > 1:
                raise WeightSyncFailed("; ".join(map(str, failure)), getattr(failure[0], "status", 500))
            raise failure[0]

    def bus_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> list[dict]:
        c = self.c
        return [{**UpdateMeta(metas).to_info(), "packed": c.packed,
                 **({"packed_buffer_size_bytes": c.buffer_size} if c.buffer_size else {})}]

    def after_announce(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None:
        """Bus path: the coordinator pauses and starts; the workers then receive what this broadcasts."""
        self.broadcast(tensors, metas)

    def broadcast(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta], stop=lambda: False) -> None:
        """One broadcast per tensor, or vLLM's packed producer: chunks closed once they exceed the buffer
        size, num_buffers in flight."""
        c = self.c
        if not c.packed:
            pending: deque = deque()
            for _, t in tensors:
                if stop():
                    break
                if len(pending) == IN_FLIGHT:
                    pending.popleft().wait()
                pending.append(self.group.broadcast_async(t, 0))
            for w in pending:
                w.wait()
            return
        chunks = plan_chunks(metas, c.buffer_size or DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        widest = max(sum(metas[i].nbytes for i in ch) for ch in chunks)
        n = min(c.num_buffers, len(chunks))
        if len(self._pack_bufs) < n or any(b.numel() < widest for b in self._pack_bufs[:n]):
            self._pack_bufs = [torch.empty(widest, dtype=torch.uint8, device=tensors[0][1].device) for _ in range(n)]
        inflight: list[Any] = []
        for k, chunk in enumerate(chunks):
            if stop():
                break
            if len(inflight) >= n:
                inflight.pop(0).wait()  # its buffer is free again
            buf = self._pack_bufs[k % n][:sum(metas[i].nbytes for i in chunk)]
            pack(buf, [tensors[i][1] for i in chunk])
            inflight.append(self.group.broadcast_async(buf, 0))
        for w in inflight:
            w.wait()

    def close(self) -> None:
        from engine.trainer.client import WeightSyncFailed

        if self.group is not None:
            for url in self.c.urls or [None]:
                try:
                    if url is None:
                        self.c._control("/shutdown_weight_transfer_engine", {}, 30)
                    else:
                        self.c._post("/shutdown_weight_transfer_engine", None, url)
                except (WeightSyncFailed, OSError):
                    pass
            self.group.destroy()
            self.group = None
        self._pack_bufs = []


def opt_bool(info: dict[str, Any], key: str, default: bool) -> bool:
    v = info.get(key, default)
    if not isinstance(v, bool):
        raise WeightSyncError(f"{key} must be true or false, got {v!r}", param=key)
    return v


def opt_int(info: dict[str, Any], key: str, default: int) -> int:
    v = info.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise WeightSyncError(f"{key} must be a positive integer, got {v!r}", param=key)
    return v


def capture(failure: list[BaseException], fn):
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
