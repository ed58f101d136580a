"""A worker's side of weight transfer: the update state machine, validation against the model and staging;
the bytes come through the configured backend (engine.weights.backends). Device code; no sockets (the
worker actor calls in).

One update goes start -> update_weights (one or more calls) -> finish -> commit, or -> abort at any point.
Every call is validated in full (names, shapes, dtypes, handles) before its first byte is written. With
staging (the default) bytes land in a second copy of each touched parameter; commit fills the parts of
those copies the update did not cover from the live weights and swaps them in, so the weights in service
never mix versions and abort simply drops the copies. The copies are kept for the next update (the old
storage becomes the next staging area), released on sleep and on shutdown. Bytes a trainer lends
(engine.weights.ipc: a lent segment) that hold a whole parameter laid out as the engine's become its staging
copy as they are, with no copy; such storage is never pooled, so it goes back to the trainer once the
parameter no longer uses it (a later commit, an abort, a sleep).

Tensor parallelism: the trainer sends whole HF tensors to every worker (vLLM's protocol); each validates
the whole shape and keeps its part (model.weight_source), so nothing about the protocol changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ascend_ops.platform import bulk_copy_threads
from bus.messages import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    InitInfo,
    RefusedUpdate,
    TransferReady,
    UpdateAborted,
    UpdateCommitted,
    UpdateFinished,
    UpdateInfo,
    WeightsReceived,
)
from engine.weights import backends
from engine.weights.config import WeightTransferConfig
from engine.weights.protocol import ParamMeta, owner_lookup, tensor_checksum
from engine.weights.wire import NOT_CONFIGURED, WeightSyncError

IDLE, ACTIVE, FINISHED = "idle", "active", "finished"


@dataclass(slots=True)
class _Touched:
    """One parameter an update writes: its staging tensor and the flat ranges written so far."""

    param: torch.nn.Parameter
    stage: torch.Tensor | None  # None when writing in place
    ranges: list[tuple[int, int]] = field(default_factory=list)
    full: bool = False  # staging already holds every element (pre-filled, or a whole-tensor write)
    lent: bool = False  # stage is the trainer's lent memory


class WeightReceiver:
    def __init__(self, model: torch.nn.Module, cfg: WeightTransferConfig | None, *, rank: int,
                 device: torch.device, nz_mode: int = 0):
        self.model, self.cfg, self.rank, self.device, self.nz_mode = model, cfg, rank, device, nz_mode
        self.backend = backends.receiver(cfg.backend) if cfg is not None else None
        self.state, self.was_shut_down = IDLE, False
        self.packed, self.buffer_size, self.num_buffers = False, DEFAULT_PACKED_BUFFER_SIZE_BYTES, \
            DEFAULT_PACKED_NUM_BUFFERS
        self.touched: dict[str, _Touched] = {}
        # staging storage kept between updates, two per parameter at most: a copied update after a lent one
        # (whose old storage goes back to the trainer) then still finds one
        self.pool: dict[str, list[torch.Tensor]] = {}
        self.lent: dict[str, int] = {}  # parameter -> data_ptr of the lent memory it serves from
        self.copy = None  # bulk_copy_threads' copy(dst, src) during an update
        self.received: list[str] = []  # names of the update in progress, in order
        self.refresh()
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
            raise WeightSyncError(NOT_CONFIGURED, status=400)
        return self.backend

    def init(self, info: InitInfo) -> TransferReady:
        """init_info, decoded and checked at the edge (engine.weights.wire)."""
        backend = self._require_backend()
        if self.state != IDLE:
            raise WeightSyncError("cannot initialise the weight transfer engine during an update", status=409)
        self.packed, self.buffer_size, self.num_buffers = info.packed, info.packed_buffer_size_bytes, \
            info.packed_num_buffers
        backend.init(info, self)
        self.was_shut_down = False
        return TransferReady(self.cfg.backend, self.packed)

    def start(self, weights_asleep: bool) -> None:
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

    def require_active(self, step: str = "update_weights.") -> None:
        if self.state != ACTIVE:
            raise WeightSyncError(f"start_weight_update must be called before {step}", status=409)

    def finish(self) -> UpdateFinished:
        self.require_active("finish_weight_update")
        if self.lora is not None:
            self.lora.finish()
        self.state = FINISHED
        return UpdateFinished(len(self.received))

    def commit(self) -> UpdateCommitted:
        """Swap the staged copies in (every worker finished)."""
        if self.state != FINISHED:
            return UpdateCommitted(False)
        if self.lora is not None:
            stage, self.lora, self.state = self.lora, None, IDLE
            stage.commit()
            return UpdateCommitted(True, len(self.received), 0)
        staged = {n: t for n, t in self.touched.items() if t.stage is not None}
        with bulk_copy_threads() as copy:
            for pname, t in staged.items():
                if not t.full:
                    _fill_gaps(t, copy)
        for pname, t in staged.items():
            if self.lent.pop(pname, None) != t.param.data_ptr():  # lent memory goes back, never into the pool
                self._keep(pname, t.param.data)
            t.param.data = t.stage
            if t.lent:
                self.lent[pname] = t.stage.data_ptr()
        self.state, self.touched = IDLE, {}
        return UpdateCommitted(True, len(self.received), len(staged))

    def abort(self) -> UpdateAborted:
        """Drop the update in progress; with staging the weights in service never changed."""
        was, self.lora = self.state, None
        for n, t in self.touched.items():
            if t.stage is not None and not t.lent:
                self._keep(n, t.stage)
        self.state, self.touched = IDLE, {}
        return UpdateAborted(was != IDLE, self.cfg is not None and not self.cfg.stage_updates)

    def shutdown(self) -> None:
        if self.state != IDLE:
            raise WeightSyncError("cannot shut down the weight transfer engine during an update", status=409)
        self.release()
        if self.backend is not None:
            self.backend.shutdown()
        self.was_shut_down = True

    def release_group(self) -> bool:
        """sleep_mode_extra_cleanup: tear the collective group down (its communicator buffers go with it).
        The trainer forms a new one with /init_weight_transfer_engine after the wake."""
        return self.backend is not None and self.backend.release_group()

    def _keep(self, pname: str, storage: torch.Tensor) -> None:
        kept = self.pool.setdefault(pname, [])
        kept[:] = kept[-1:] + [storage]

    def release(self) -> int:
        """Free the staging copies and receive buffers (sleep); returns bytes released."""
        freed = sum(t.numel() * t.element_size() for ts in self.pool.values() for t in ts)
        self.pool.clear()
        return freed + (self.backend.release() if self.backend is not None else 0)

    # --- update_weights -------------------------------------------------------------------------

    def update(self, info: UpdateInfo) -> WeightsReceived:
        """One update_weights call: an edge-checked update_info, or the edge's RefusedUpdate (the backend ends
        the call as the trainer needs, then it fails with the edge's 400)."""
        backend = self._require_backend()
        if self.was_shut_down:
            raise WeightSyncError("the weight transfer engine was shut down: no update is possible until "
                                  "/init_weight_transfer_engine", status=409)
        if isinstance(info, RefusedUpdate):
            self.require_active()
            raise WeightSyncError(info.message + backend.drain(info.wire, self), param=info.param)
        return WeightsReceived(*backend.update(info, self))

    @contextmanager
    def copying(self):
        """The bulk copy threads for the writes of one update_weights call (self.copy meanwhile)."""
        with bulk_copy_threads() as self.copy:
            yield

    def validate(self, params: list[ParamMeta]) -> list[torch.Tensor]:
        """Every name known, every shape and dtype equal to the engine's, before anything is written."""
        dests = []
        model = self.lora or self.model
        for p in params:
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

    def adopts(self) -> bool:
        """Whether lent bytes may become staging copies (staging on, the model as the target)."""
        return self.lora is None and self.cfg is not None and self.cfg.stage_updates

    def place(self, items: list[tuple[str, torch.Tensor, torch.Tensor]], lent: set[int]) -> None:
        """Each received (name, src, dst) written; a parameter whose every byte this call sends, in its own
        layout, from a lent segment (`lent`: their storages' addresses) takes those bytes as its staging copy."""
        by_param: dict[str, list] = {}
        for item in items:
            by_param.setdefault(self.owner(item[2]) if lent else "", []).append(item)
        for pname, its in by_param.items():
            view = self._adoptable(pname, its) if lent else None
            if view is not None and view.untyped_storage().data_ptr() in lent:
                self.touched[pname] = _Touched(self._params[pname], view, full=True, lent=True)
                continue
            for name, src, dst in its:
                self.write(name, src, dst)

    def _adoptable(self, pname: str, items: list[tuple[str, torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """A view of the sources shaped as parameter `pname`, when they are its bytes back to back in order
        (as the fused q/k/v pieces a trainer sends one after another), in its dtype, whole; else None."""
        live = self._params[pname].data
        if pname in self.touched or not live.is_contiguous():
            return None
        items = sorted(items, key=lambda it: it[2].data_ptr())
        first, pos = items[0][1], live.data_ptr()
        for name, src, dst in items:
            if (dst.data_ptr() != pos or not dst.is_contiguous() or not src.is_contiguous()
                    or (src.dtype, src.device) != (live.dtype, live.device)
                    or src.data_ptr() - first.data_ptr() != pos - live.data_ptr()
                    or src.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                    or self.source(name, src) is not src):
                return None
            pos += dst.numel() * dst.element_size()
        if pos != live.data_ptr() + live.numel() * live.element_size():
            return None
        return first.as_strided(live.shape, live.stride())

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
        pname = self.owner(dst)
        t = self.touched.get(pname)
        param = self._params[pname]
        if t is None:
            stage = None
            if self.cfg is not None and self.cfg.stage_updates:
                stage = self.pool[pname].pop() if self.pool.get(pname) else None
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

    def refresh(self) -> None:
        """Parameter storage moved (wake from sleep, commit): re-learn which storage is which parameter."""
        self._params = dict(self.model.named_parameters())
        self.owner = owner_lookup(self._params)

    # --- /weight_checker ------------------------------------------------------------------------

    def checksums(self, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
        """sha256 per tensor under the names a trainer sends (HF names), prefixed per worker; with tensor
        parallelism, of this worker's part (as vLLM's per-shard keys). Second: the stacked expert tensors under
        their transformers-5 in-memory names (model.checksum_names), which a compare also accepts."""
        listed = self.model.required_weight_names()
        sums = {n: tensor_checksum(self.model.weight_destination(n)) for n in sorted(self.model.checksum_names())}
        return ({prefix + n: v for n, v in sums.items() if n in listed},
                {prefix + n: v for n, v in sums.items() if n not in listed})


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
