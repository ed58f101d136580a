"""A worker's side of weight transfer: the update state machine, validation against the model and staging;
the bytes come through the configured backend (engine.weights.backends). Device code; no sockets (the
worker actor calls in).

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

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from ascend_ops.platform import bulk_copy_threads
from engine.weights import backends
from engine.weights.collective_backend import opt_bool, opt_int
from engine.weights.config import WeightTransferConfig
from engine.weights.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    UpdateMeta,
    WeightSyncError,
    tensor_checksum,
)

log = structlog.get_logger()

IDLE, ACTIVE, FINISHED = "idle", "active", "finished"


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
        self.backend = backends.receiver(cfg.backend) if cfg is not None else None
        self.state = IDLE
        self.initialized = False
        self.was_shut_down = False
        self.packed = False
        self.buffer_size = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        self.touched: dict[str, _Touched] = {}
        self.pool: dict[str, torch.Tensor] = {}  # staging storage kept between updates
        self._params: dict[str, torch.nn.Parameter] = {}
        self.copy = None  # bulk_copy_threads' copy(dst, src) during an update
        self.received: list[str] = []  # names of the update in progress, in order
        self._owner = self._storage_owners()
        # an adapter as the next update's target instead of the model (workers/lora_stage.py): it names the
        # destinations, checks at finish, keeps the tensors at commit; never staged over live weights
        self.lora = None

    def arm_lora(self, stage) -> None:
        if self.state != IDLE:
            raise WeightSyncError("a LoRA receive target must be set before start_weight_update", status=409)
        if self.lora is not None:
            raise WeightSyncError(f"a LoRA receive target is already armed for {self.lora.target.lora_name!r}; "
                                  "finish that update first", status=409)
        self.lora = stage

    # --- lifecycle ------------------------------------------------------------------------------

    def _require_backend(self) -> backends.Receiver:
        if self.backend is None:
            raise WeightSyncError("weight transfer is not configured: start the server with "
                                  "--weight-transfer-config '{\"backend\": \"ipc\"}' (or hccl)", status=400)
        return self.backend

    def init(self, info: dict[str, Any]) -> dict[str, Any]:
        backend = self._require_backend()
        if self.state != IDLE:
            raise WeightSyncError("cannot initialise the weight transfer engine during an update", status=409)
        self.packed = opt_bool(info, "packed", False)
        self.buffer_size = opt_int(info, "packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        self.num_buffers = opt_int(info, "packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)
        backend.init(info, self)
        self.initialized, self.was_shut_down = True, False
        return {"backend": self.cfg.backend, "packed": self.packed}

    def start(self, weights_asleep: bool) -> dict[str, Any]:
        backend = self._require_backend()
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: call /init_weight_transfer_engine "
                                  "again first", status=409, param="init_info")
        if self.state != IDLE:
            raise WeightSyncError("a weight update is already active: finish_weight_update (or its failure) "
                                  "must end it before start_weight_update", status=409)
        backend.check_start()
        if self.nz_mode:
            raise WeightSyncError("weight updates need the NZ weight format off (RL mode turns it off)", status=409)
        if weights_asleep:
            raise WeightSyncError("the weights are asleep: /wake_up?tags=weights before updating them", status=409)
        self.refresh()  # parameter storage may have moved since the last update (commit, sleep)
        self.state, self.touched, self.received = ACTIVE, {}, []
        return {"started": True}

    def require_active(self) -> None:
        if self.state != ACTIVE:
            raise WeightSyncError("start_weight_update must be called before update_weights.", status=409)

    def finish(self) -> dict[str, Any]:
        if self.state != ACTIVE:
            raise WeightSyncError("start_weight_update must be called before finish_weight_update", status=409)
        if self.lora is not None:
            self.lora.finish()
        self.state = FINISHED
        return {"tensors": len(self.received)}

    def commit(self) -> dict[str, Any]:
        """Swap the staged copies in (every worker finished). Returns what changed."""
        if self.state != FINISHED:
            return {"committed": False}
        if self.lora is not None:
            stage, self.lora, self.state = self.lora, None, IDLE
            stage.commit()
            return {"committed": True, "tensors": len(self.received), "parameters": 0}
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
        was, self.lora = self.state, None
        for pname, t in self.touched.items():
            if t.stage is not None:
                self.pool[pname] = t.stage
        self.state, self.touched = IDLE, {}
        return {"aborted": was != IDLE, "in_place": self.cfg is not None and not self.cfg.stage_updates}

    def shutdown(self) -> dict[str, Any]:
        if self.state != IDLE:
            raise WeightSyncError("cannot shut down the weight transfer engine during an update", status=409)
        self.release()
        if self.backend is not None:
            self.backend.shutdown()
        self.initialized, self.was_shut_down = False, True
        return {"shutdown": True}

    def release_group(self) -> bool:
        """sleep_mode_extra_cleanup: tear the collective group down (its communicator buffers go with it).
        The trainer forms a new one with /init_weight_transfer_engine after the wake."""
        return self.backend is not None and self.backend.release_group()

    def release(self) -> int:
        """Free the staging copies and receive buffers (sleep); returns bytes released."""
        freed = sum(t.numel() * t.element_size() for t in self.pool.values())
        self.pool.clear()
        return freed + (self.backend.release() if self.backend is not None else 0)

    # --- update_weights -------------------------------------------------------------------------

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        backend = self._require_backend()
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: no update is possible until "
                                  "/init_weight_transfer_engine", status=409)
        return backend.update(info, self)

    @contextmanager
    def copying(self):
        """The bulk copy threads for the writes of one update_weights call (self.copy meanwhile)."""
        with bulk_copy_threads() as self.copy:
            yield

    def validate(self, meta: UpdateMeta) -> list[torch.Tensor]:
        """Every name known, every shape and dtype equal to the engine's, before anything is written."""
        dests = []
        model = self.lora or self.model
        for p in meta.params:
            try:
                dst = model.weight_destination(p.name)
            except KeyError:
                raise WeightSyncError(f"unknown parameter name {p.name!r}", param="names") from None
            full = model.weight_full_shape(p.name)
            if full != p.shape:
                raise WeightSyncError(f"tensor {p.name!r}: shape {list(p.shape)} does not match the engine's "
                                      f"{list(full)}", param="shapes")
            check_castable(p.name, p.dtype, dst.dtype)
            dests.append(dst)
        return dests

    def write(self, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One received tensor (whole, as the trainer sent it) into our part of it, cast to the engine's dtype
        on the way (torch's copy_: round to nearest even, as vLLM's load)."""
        self.copy(self.target(dst), self.source(name, src))

    def source(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """Our part of a received tensor (tensor parallelism: model.weight_source)."""
        return (self.lora or self.model).weight_source(name, src)

    def target(self, dst: torch.Tensor) -> torch.Tensor:
        """Where bytes for the live view `dst` go: the same view of the staging copy (or dst in place)."""
        if self.lora is not None:
            return dst  # a fresh buffer of the adapter's, not a weight in service
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


def _fill_gaps(t: _Touched, copy) -> None:
    """Copy from the live weights every element of the staging copy that the update did not write."""
    live, stage = t.param.data.reshape(-1), t.stage.reshape(-1)
    pos = 0
    for a, b in sorted(t.ranges) + [(live.numel(), live.numel())]:
        if a > pos:
            copy(stage[pos:a], live[pos:a])
        pos = max(pos, b)
