"""A worker's side of weight transfer: the update state machine, validation, staging and the two data
paths (IPC handles, collective broadcast). Device code; no sockets (the worker actor calls in).

One update goes start -> update_weights (one or more calls) -> finish -> commit, or -> abort at any point.
Every call is validated in full (names, shapes, dtypes, handles) before its first byte is written. With
staging (the default) bytes land in a second copy of each touched parameter; commit fills the parts of
those copies the update did not cover from the live weights and swaps them in, so the weights in service
never mix versions and abort simply drops the copies. The copies are kept for the next update (the old
storage becomes the next staging area), released on sleep and on shutdown.

Tensor parallelism: the trainer sends whole HF tensors to every worker (vLLM's protocol); each validates
the whole shape and keeps its part (model.weight_source), so nothing about the protocol changes.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from ascend_ops.platform import bulk_copy_threads
from engine.weight_transfer_config import WeightTransferConfig
from engine.weight_update import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    ParamMeta,
    UpdateMeta,
    WeightSyncError,
    byte_views,
    plan_chunks,
    tensor_checksum,
)

log = structlog.get_logger()

IDLE, ACTIVE, FINISHED = "idle", "active", "finished"
# vLLM's NCCLWeightTransferInitInfo fields, plus rollbus's timeout_s
INIT_INFO_KEYS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
                            "packed", "packed_buffer_size_bytes", "packed_num_buffers", "timeout_s"})


@dataclass(slots=True)
class _Touched:
    """One parameter an update writes: its staging tensor and the flat ranges written so far."""

    param: torch.nn.Parameter
    stage: torch.Tensor | None  # None when writing in place
    ranges: list[tuple[int, int]] = field(default_factory=list)
    full: bool = False  # staging already holds every element (pre-filled, or a whole-tensor write)


class WeightReceiver:
    def __init__(self, model: torch.nn.Module, cfg: WeightTransferConfig | None, *, rank: int,
                 device: torch.device, nz_mode: int = 0):
        self.model, self.cfg, self.rank, self.device = model, cfg, rank, device
        self.nz_mode = nz_mode
        self.state = IDLE
        self.initialized = False
        self.was_shut_down = False
        self.packed = False
        self.buffer_size = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        self.group = None  # ascend_ops.collective.WeightGroup for the collective backend
        self.group_released = False  # by a sleep with sleep_mode_extra_cleanup
        self.importer = None  # ascend_ops.ipc.HandleImporter for the ipc backend
        self.touched: dict[str, _Touched] = {}
        self.pool: dict[str, torch.Tensor] = {}  # staging storage kept between updates
        self._recv: list[torch.Tensor] = []  # packed collective receive buffers, kept between updates
        self._params: dict[str, torch.nn.Parameter] = {}
        self._copy = None  # bulk_copy_threads' copy(dst, src) during an update
        self.received: list[str] = []  # names of the update in progress, in order
        self._last_wire: dict[str, Any] | None = None  # names/dtype_names/shapes vLLM 0.33 may leave out
        self._group_lost: str | None = None  # why the collective group was torn down behind the trainer
        self._owner = self._storage_owners()

    # --- lifecycle ------------------------------------------------------------------------------

    def _require_backend(self) -> WeightTransferConfig:
        if self.cfg is None:
            raise WeightSyncError("weight transfer is not configured: start the server with "
                                  "--weight-transfer-config '{\"backend\": \"ipc\"}' (or hccl)", status=400)
        return self.cfg

    def init(self, info: dict[str, Any]) -> dict[str, Any]:
        cfg = self._require_backend()
        if self.state != IDLE:
            raise WeightSyncError("cannot initialise the weight transfer engine during an update", status=409)
        self.packed = _opt_bool(info, "packed", False)
        self.buffer_size = _opt_int(info, "packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        self.num_buffers = _opt_int(info, "packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)
        if cfg.backend == "hccl":
            self._init_collective(info, cfg)
        else:
            from ascend_ops.ipc import HandleImporter

            self.importer = self.importer or HandleImporter()
        self.initialized, self.was_shut_down, self.group_released = True, False, False
        return {"backend": cfg.backend, "packed": self.packed}

    def start(self, weights_asleep: bool) -> dict[str, Any]:
        cfg = self._require_backend()
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: call /init_weight_transfer_engine "
                                  "again first", status=409, param="init_info")
        if self.state != IDLE:
            raise WeightSyncError("a weight update is already active: finish_weight_update (or its failure) "
                                  "must end it before start_weight_update", status=409)
        if cfg.backend == "hccl" and self.group is None:
            why = (" (a sleep with sleep_mode_extra_cleanup released the group: initialise it again)"
                   if self.group_released else f" ({self._group_lost})" if self._group_lost else "")
            raise WeightSyncError(f"the hccl backend needs /init_weight_transfer_engine before an update{why}",
                                  status=409, param="init_info")
        if self.nz_mode:
            raise WeightSyncError("weight updates need the NZ weight format off (RL mode turns it off)", status=409)
        if weights_asleep:
            raise WeightSyncError("the weights are asleep: /wake_up?tags=weights before updating them", status=409)
        if cfg.backend == "ipc" and self.importer is None:
            from ascend_ops.ipc import HandleImporter

            self.importer = HandleImporter()
        if self.importer is not None:
            self.importer.prune()  # drop mappings of buffers their trainer has closed
        self.refresh()  # parameter storage may have moved since the last update (commit, sleep)
        self.state, self.touched, self.received = ACTIVE, {}, []
        return {"started": True}

    def finish(self) -> dict[str, Any]:
        if self.state != ACTIVE:
            raise WeightSyncError("start_weight_update must be called before finish_weight_update", status=409)
        self.state = FINISHED
        return {"tensors": len(self.received)}

    def commit(self) -> dict[str, Any]:
        """Swap the staged copies in (every worker finished). Returns what changed."""
        if self.state != FINISHED:
            return {"committed": False}
        n = 0
        for pname, t in self.touched.items():
            if t.stage is None:
                continue
            if not t.full:
                with bulk_copy_threads() as copy:
                    _fill_gaps(t, copy)
            live = t.param.data
            t.param.data = t.stage
            self.pool[pname] = live
            n += 1
        self.state, self.touched = IDLE, {}
        return {"committed": True, "tensors": len(self.received), "parameters": n}

    def abort(self) -> dict[str, Any]:
        """Drop the update in progress; with staging the weights in service never changed."""
        was = self.state
        for pname, t in self.touched.items():
            if t.stage is not None:
                self.pool[pname] = t.stage
        self.state, self.touched = IDLE, {}
        return {"aborted": was != IDLE, "in_place": self.cfg is not None and not self.cfg.stage_updates}

    def shutdown(self) -> dict[str, Any]:
        if self.state != IDLE:
            raise WeightSyncError("cannot shut down the weight transfer engine during an update", status=409)
        self.release()
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.importer is not None:
            self.importer.close()
            self.importer = None
        self.initialized, self.was_shut_down = False, True
        return {"shutdown": True}

    def release_group(self) -> bool:
        """sleep_mode_extra_cleanup: tear the collective group down (its communicator buffers go with it).
        The trainer forms a new one with /init_weight_transfer_engine after the wake."""
        if self.group is None:
            return False
        self.group.destroy()
        self.group = None
        self.group_released = True
        return True

    def release(self) -> int:
        """Free the staging copies (sleep); returns bytes released."""
        freed = sum(t.numel() * t.element_size() for t in [*self.pool.values(), *self._recv])
        self.pool.clear()
        self._recv = []
        return freed

    # --- update_weights -------------------------------------------------------------------------

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        cfg = self._require_backend()
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: no update is possible until "
                                  "/init_weight_transfer_engine", status=409)
        if cfg.backend == "hccl":
            return self._update_collective(info)
        if self.state != ACTIVE:
            raise WeightSyncError("start_weight_update must be called before update_weights.", status=409)
        meta = UpdateMeta.parse(info)
        dests = self._validate(meta)
        try:
            with bulk_copy_threads() as self._copy:
                self._receive_ipc(info, meta, dests)
        except WeightSyncError:
            raise
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}", status=500) from None
        self.received += [p.name for p in meta.params]
        return {"tensors": len(meta.params), "bytes": meta.nbytes}

    def _validate(self, meta: UpdateMeta) -> list[torch.Tensor]:
        """Every name known, every shape and dtype equal to the engine's, before anything is written."""
        dests = []
        for p in meta.params:
            try:
                dst = self.model.weight_destination(p.name)
            except KeyError:
                raise WeightSyncError(f"unknown parameter name {p.name!r}", param="names") from None
            full = self.model.weight_full_shape(p.name)
            if full != p.shape:
                raise WeightSyncError(f"tensor {p.name!r}: shape {list(p.shape)} does not match the engine's "
                                      f"{list(full)}", param="shapes")
            check_castable(p.name, p.dtype, dst.dtype)
            dests.append(dst)
        return dests

    def _target(self, dst: torch.Tensor) -> torch.Tensor:
        """Where bytes for the live view `dst` go: the same view of the staging copy (or dst in place)."""
        pname = self._owner[dst.untyped_storage().data_ptr()]
        t = self.touched.get(pname)
        param = self._params[pname]
        if t is None:
            stage = None
            if self.cfg is not None and self.cfg.stage_updates:
                stage = self.pool.pop(pname, None)
                if stage is None or stage.shape != param.shape or stage.dtype != param.dtype:
                    stage = torch.empty_like(param.data)
            t = self.touched[pname] = _Touched(param, stage)
        if t.stage is None:
            return dst
        base = param.data.storage_offset()
        off = dst.storage_offset() - base
        if not dst.is_contiguous() and not t.full:
            t.stage.copy_(param.data)  # cannot track a strided range: start from the live values
            t.full = True
        elif dst.is_contiguous():
            if dst.numel() == param.numel():
                t.full = True
            t.ranges.append((off, off + dst.numel()))
        return t.stage.as_strided(dst.shape, dst.stride(), t.stage.storage_offset() + off)

    def _storage_owners(self) -> dict[int, str]:
        self._params = dict(self.model.named_parameters())
        return {p.untyped_storage().data_ptr(): n for n, p in self._params.items()}

    def refresh(self) -> None:
        """Parameter storage moved (wake from sleep, commit): re-learn which storage is which parameter."""
        self._owner = self._storage_owners()

    def _receive_ipc(self, info: dict[str, Any], meta: UpdateMeta, dests: list[torch.Tensor]) -> None:
        if info.get("ipc_handles_pickled") is not None:
            handles = self._pickled_handles(info, meta)
        else:
            handles = info.get("ipc_handles")
        if isinstance(handles, dict | torch.Tensor):  # packed: one buffer holding every tensor back to back
            sizes = info.get("tensor_sizes")
            if sizes is not None and sizes != [p.nbytes for p in meta.params]:
                raise WeightSyncError("update_info.tensor_sizes does not match names/dtype_names/shapes",
                                      param="tensor_sizes")
            buf = self._open(handles, meta.nbytes, "ipc_handles")
            sources = byte_views(buf, meta.params)
        elif isinstance(handles, list):
            if len(handles) != len(meta.params):
                raise WeightSyncError(f"update_info.ipc_handles has {len(handles)} entries for "
                                      f"{len(meta.params)} names", param="ipc_handles")
            sources = [byte_views(self._open(h, p.nbytes, f"ipc_handles[{i}]"), [p])[0]
                       for i, (h, p) in enumerate(zip(handles, meta.params))]
        else:
            raise WeightSyncError("update_info.ipc_handles must be a list (one handle per tensor) or one "
                                  "handle object (packed)", param="ipc_handles")
        # Everything is mapped and checked: now write.
        for p, src, dst in zip(meta.params, sources, dests):
            receive_into(self._target(dst), self.model.weight_source(p.name, src), self._copy)

    def _pickled_handles(self, info: dict[str, Any], meta: UpdateMeta) -> Any:
        """vLLM's ``ipc_handles_pickled`` (its HTTP client's form of reduce_tensor's args) -> the handles
        ``_open`` takes, every field checked against the declared tensors; see ascend_ops.ipc."""
        from ascend_ops import ipc

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
                                                  self.device, where)
            if not isinstance(obj, list):
                raise ValueError(f"{where} must hold a list (one handle dict per tensor) or one dict (packed), "
                                 f"got {type(obj).__name__}")
            if len(obj) != len(meta.params):
                raise ValueError(f"`ipc_handles` should be of the same size as `names`: got {len(obj)} and "
                                 f"{len(meta.params)}")
            return [ipc.resolve_pickled_handle(h, ipc.Expect(p.dtype, p.shape), self.device,
                                               f"{where}[{i}] ({p.name!r})")
                    for i, (h, p) in enumerate(zip(obj, meta.params))]
        except ValueError as e:
            raise WeightSyncError(str(e), param="ipc_handles_pickled") from None

    def _open(self, handle: Any, nbytes: int, where: str) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):  # a CPU trainer's inline bytes (pickled handles), already checked
            return handle
        try:
            buf = self.importer.open(handle, self.device)  # type: ignore[union-attr]
        except ValueError as e:
            raise WeightSyncError(f"update_info.{where}: {e}", param="ipc_handles") from None
        if buf.numel() != nbytes:
            raise WeightSyncError(f"update_info.{where} covers {buf.numel()} bytes, the tensors need {nbytes}",
                                  param="ipc_handles")
        return buf

    # --- collective backend (vLLM's NCCL weight-transfer engine protocol; ascend_ops.collective) -----------

    def _init_collective(self, info: dict[str, Any], cfg: WeightTransferConfig) -> None:
        """Join the trainer's group as rank rank_offset + dp_rank x tp + tp_rank (self.rank is that global
        worker index; pp = 1). init_info is vLLM's NCCLWeightTransferInitInfo."""
        import base64
        import binascii

        from ascend_ops.collective import StoreCollision, WeightGroup

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
        my_rank = offset + self.rank
        if not 0 < my_rank < world:
            raise WeightSyncError(f"worker rank {my_rank} (rank_offset {offset} + worker {self.rank}) is outside "
                                  f"world_size {world}; the trainer is rank 0", param="world_size")
        timeout = info.get("timeout_s", cfg.timeout_s)
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
                self.group = WeightGroup.from_unique_id(uid, my_rank, world, self.device)
            else:
                self.group = WeightGroup.create(addr, port, my_rank, world, float(timeout), self.device,
                                                op_timeout_s=float(timeout))
        except TimeoutError as e:
            raise WeightSyncError(str(e), status=504) from None
        except StoreCollision as e:
            raise WeightSyncError(str(e), status=409) from None
        except (ValueError, pickle.UnpicklingError) as e:  # a bad store object (naming its global), a uid off CUDA
            raise WeightSyncError(str(e), status=400) from None
        except (OSError, RuntimeError) as e:  # ConnectionError, an unloadable library, a failed init
            raise WeightSyncError(f"weight-transfer rendezvous failed: {e}", status=502) from None

    def _update_collective(self, info: dict[str, Any]) -> dict[str, Any]:
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
        packed = info.get("packed", self.packed)
        size = info.get("packed_buffer_size_bytes", self.buffer_size)
        nbuf = info.get("packed_num_buffers", self.num_buffers)
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: no update is possible until "
                                  "/init_weight_transfer_engine", status=409)
        if self.state != ACTIVE:
            raise WeightSyncError("start_weight_update must be called before update_weights.", status=409)
        if self.group is None:
            raise WeightSyncError("the hccl backend needs /init_weight_transfer_engine before an update"
                                  + (f" ({self._group_lost})" if self._group_lost else ""), status=409)
        try:
            packed = _opt_bool(info, "packed", self.packed)
            size = _opt_int(info, "packed_buffer_size_bytes", self.buffer_size)
            nbuf = _opt_int(info, "packed_num_buffers", self.num_buffers)
            if resolved is None:
                raise WeightSyncError("update_info.names is empty and no earlier update_weights call of this "
                                      "group left metadata to reuse", param="names")
            meta = UpdateMeta.parse(resolved)
            dests = self._validate(meta)
        except WeightSyncError as e:
            if e.status != 400:
                raise
            raise WeightSyncError(f"{e}{self._discard(wire, packed, size, nbuf)}", status=400, param=e.param) from None
        try:
            with bulk_copy_threads() as self._copy:
                failure = self._receive_collective(meta.params, dests, packed, size, nbuf)
        except TimeoutError as e:
            raise WeightSyncError(f"weight transfer timed out: {e}", status=504) from None
        except Exception as e:  # the group itself failed: it cannot be trusted to line up with the trainer
            self._lose_group(f"a broadcast failed ({type(e).__name__}: {e})")
            raise WeightSyncError(f"weight transfer failed: {type(e).__name__}: {e}; the weight-transfer group "
                                  "was torn down: initialise it again", status=500) from None
        if failure is not None:
            raise WeightSyncError(f"weight transfer failed: {type(failure).__name__}: {failure} (the rest of the "
                                  "update's broadcasts were received and discarded)", status=500)
        self.received += [p.name for p in meta.params]
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

    def _discard(self, wire: list[ParamMeta] | None, packed: Any, size: Any, nbuf: Any) -> str:
        """Take part in the refused call's broadcasts and drop the bytes; returns a note for the error."""
        if not isinstance(packed, bool):
            packed = self.packed
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            size = self.buffer_size
        if not isinstance(nbuf, int) or isinstance(nbuf, bool) or nbuf <= 0:
            nbuf = self.num_buffers
        if not wire:
            self._lose_group("update_weights metadata could not be read, so its broadcasts could not be received")
            return ("; the broadcasts of this call could not be sized, so the weight-transfer group was torn "
                    "down: initialise it again")
        try:
            self._receive_collective(wire, None, packed, size, nbuf)
        except Exception as e:
            self._lose_group(f"discarding a refused update failed ({type(e).__name__}: {e})")
            return f"; discarding its broadcasts failed ({type(e).__name__}: {e}), the group was torn down"
        return f"; its {len(wire)} tensors were received from the trainer and discarded"

    def _lose_group(self, why: str) -> None:
        if self.group is not None:
            self.group.destroy(abort=True)
            self.group = None
        self._group_lost = f"the weight-transfer group was torn down: {why}"

    def _receive_collective(self, params: list[ParamMeta], dests: list[torch.Tensor] | None, packed: bool,
                            size: int, nbuf: int) -> BaseException | None:
        """Take part in every broadcast of one update_weights call, in vLLM's order: one per tensor in its own
        dtype, or (packed) one uint8 buffer per chunk of plan_chunks. ``dests`` None: discard everything. A
        failure while writing does not stop the receiving: it is returned once every broadcast is done."""
        group = self.group
        failure: BaseException | None = None
        if not packed:
            scratch: torch.Tensor | None = None  # for tensors not received in place (allocated once, lazily)
            for i, p in enumerate(params):
                target = None
                if dests is not None and failure is None:
                    try:
                        target = self._target(dests[i])
                    except Exception as e:
                        failure = e
                if target is not None and target.is_contiguous() and target.dtype == p.dtype \
                        and tuple(target.shape) == p.shape:  # the whole tensor is ours: receive in place
                    group.broadcast(target, 0)
                    continue
                if scratch is None:
                    scratch = torch.empty(max(q.nbytes for q in params), dtype=torch.uint8, device=self.device)
                buf = scratch[:p.nbytes].view(p.dtype).view(p.shape)
                group.broadcast(buf, 0)
                if target is not None:
                    try:
                        # our part of it; casts when the trainer's dtype differs
                        receive_into(target, self.model.weight_source(p.name, buf), self._copy)
                    except Exception as e:
                        failure = e
            return failure
        chunks = plan_chunks(params, size)
        widest = max(sum(params[i].nbytes for i in c) for c in chunks)
        bufs = self._recv_buffers(min(nbuf, len(chunks)), widest)
        inflight: deque = deque()

        def consume() -> None:
            nonlocal failure
            chunk, buf, work = inflight.popleft()
            work.wait()
            if dests is None or failure is not None:
                return
            try:
                for i, src in zip(chunk, byte_views(buf, [params[i] for i in chunk])):
                    receive_into(self._target(dests[i]), self.model.weight_source(params[i].name, src),
                                 self._copy)
            except Exception as e:
                failure = e

        for ci, chunk in enumerate(chunks):
            if len(inflight) == len(bufs):
                consume()
            buf = bufs[ci % len(bufs)][: sum(params[i].nbytes for i in chunk)]
            inflight.append((chunk, buf, group.broadcast_async(buf, 0)))
        while inflight:
            consume()
        return failure

    def _recv_buffers(self, n: int, nbytes: int) -> list[torch.Tensor]:
        """Packed receive buffers. On the host they are kept between updates (n x chunk bytes resident;
        freed by sleep and shutdown): allocating them per update cost a page fault per 4 KiB of every
        chunk. On accelerators the caching allocator makes them cheap, so they live for one update only."""
        if self.device.type != "cpu":
            return [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(n)]
        if len(self._recv) < n or any(b.numel() < nbytes for b in self._recv[:n]):
            self._recv = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(n)]
        return self._recv[:n]

    # --- /weight_checker ------------------------------------------------------------------------

    def checksums(self, prefix: str) -> dict[str, str]:
        """sha256 per tensor under the names a trainer sends (HF names), prefixed per worker; with tensor
        parallelism, of this worker's part (as vLLM's per-shard keys)."""
        names = sorted(self.model.required_weight_names())
        return {prefix + n: tensor_checksum(self.model.weight_destination(n)) for n in names}


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_castable(name: str, sent: torch.dtype, engine: torch.dtype) -> None:
    """vLLM loads a received tensor with ``param.copy_(tensor)``, which casts to the parameter's dtype; rollbus
    casts the same way, between floating dtypes only (bf16/fp16 from a trainer into an fp32 engine and back).
    Anything else (int into float weights, float into int buffers, bool) would be garbage, not a cast: a 400
    naming the tensor and both dtypes, raised before anything is written."""
    if sent == engine or (sent in FLOAT_DTYPES and engine in FLOAT_DTYPES):
        return
    raise WeightSyncError(f"tensor {name!r}: dtype {str(sent)[6:]} cannot be cast to the engine's "
                          f"{str(engine)[6:]} (only floating dtypes are cast on receive); send it as "
                          f"{str(engine)[6:]}", param="dtype_names")


def receive_into(target: torch.Tensor, src: torch.Tensor, copy) -> None:
    """Write one received tensor into its destination, cast to the engine's dtype on the way (every data path
    uses this: IPC plain-data and pickled handles, collective broadcasts). `copy` is bulk_copy_threads' copy;
    torch's copy_ does the cast (round to nearest even, as vLLM's load)."""
    copy(target, src)


def _fill_gaps(t: _Touched, copy) -> None:
    """Copy from the live weights every element of the staging copy that the update did not write."""
    live, stage = t.param.data.reshape(-1), t.stage.reshape(-1)
    pos = 0
    for a, b in sorted(t.ranges) + [(live.numel(), live.numel())]:
        if a > pos:
            copy(stage[pos:a], live[pos:a])
        pos = max(pos, b)


def _opt_bool(info: dict[str, Any], key: str, default: bool) -> bool:
    v = info.get(key, default)
    if not isinstance(v, bool):
        raise WeightSyncError(f"{key} must be true or false, got {v!r}", param=key)
    return v


def _opt_int(info: dict[str, Any], key: str, default: int) -> int:
    v = info.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise WeightSyncError(f"{key} must be a positive integer, got {v!r}", param=key)
    return v
