"""Sleep mode on a worker: release and restore device memory by tag (vLLM's `weights` and `kv_cache`).

  level 1: weights are offloaded to host memory, the KV cache is discarded
  level 2: weights and KV cache are discarded (buffers, e.g. rope tables, are kept); the weights'
           content is garbage after a wake until they are reloaded or transferred, so the manager
           counts the parameters still `missing` (the worker refuses to step while any is) and
           `mark_loaded` crosses them off as a weight update commits or reload_weights fills them

Offloading the KV cache (SkyRL's sleep_for_weight_sync, `kv_blocks`): the blocks that kept (frozen) requests
hold are copied to the host (a compact copy of just those blocks, on CPU too, where the rest of the cache
is then freed) before the cache is released, and written back into the same block ids when `kv_cache`
wakes, so the frozen requests continue on exactly the KV they had. A hybrid model's recurrent-state pool
(workers.kv_cache) is kept whole beside them, so they continue on their states too; without kv_blocks it is
discarded with the blocks, at either level.

/weight_checker reset (`zero_weights`, vLLM's): every parameter is zeroed in place and counted as missing,
like a level-2 sleep's discard, so nothing is served until an update or reload_weights has filled them.

Parameters keep their identity (the same nn.Parameter objects, only `.data` changes), so in-place
weight loading and any handle a trainer holds on names keep working after a wake. On CPU the host is
the device: offloading weights frees nothing, so level 1 releases the KV cache only and leaves the
weights in place (and their packed copies, ascend_ops.packed_linear); level 2 frees both, packed copies
included (malloc_trim hands the pages back to the OS).
"""

from __future__ import annotations

import torch

from ascend_ops import packed_linear
from ascend_ops.platform import Platform, release_host_memory
from bus.messages import WeightsStatus
from engine.weights.protocol import owner_lookup
from workers.kv_cache import KVCache

TAGS = ("weights", "kv_cache")


class SleepManager:
    def __init__(self, model: torch.nn.Module, kv: KVCache, platform: Platform):
        self.model, self.kv, self.platform = model, kv, platform
        self.asleep: set[str] = set()
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._host: dict[str, torch.Tensor] = {}  # level-1 offload of the weights (accelerators only)
        # After a level-2 sleep: parameter -> flat element ranges written since (until each is whole).
        self._discarded: dict[str, list[tuple[int, int]]] = {}
        self._kv_kept: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (block ids, their KV) while released
        # a hybrid model's state pool (conv, recurrent) kept with the blocks: the kept requests' states in it
        self._state_kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())  # shared (tied) parameters appear once

    def sleep(self, level: int, kv_blocks: list[int] | None = None) -> int:
        """Release memory; returns the bytes released on the device. With kv_blocks, those KV blocks are
        offloaded to the host and restored when kv_cache wakes."""
        if level == 0 or self.asleep:
            return 0
        released = self.kv.nbytes
        if kv_blocks:
            self._kv_kept = self._offload_kv(kv_blocks)
            if self.platform.name == "cpu":  # the copy stays in the same memory: what is freed is the rest
                released -= sum(t.numel() * t.element_size() for t in self._kv_kept[1])
            if self.kv.conv_state is not None:  # the whole pool (a few slots): the kept requests' states are in it
                self._state_kept = (self.kv.conv_state.cpu(), self.kv.rec_state.cpu())
        self.kv.release()
        offload = level == 1
        if offload and self.platform.name == "cpu":
            pass  # the host is the device: nothing to gain by copying the weights to itself
        else:
            for name, p in self._params().items():
                self._shapes[name] = (p.shape, p.dtype)
                if offload:
                    self._host[name] = p.data.to("cpu", non_blocking=True).pin_memory()
                released += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if not offload:
                self._discarded = {name: [] for name in self._shapes}
            # the CPU packed copies of the weights go with them, before the trim below: dropped after it (as
            # the worker's command wrapper did alone), their heap pages stayed resident for the whole sleep
            # (SmolLM2 fp32: ~400 MiB, as much again as the layers)
            released += packed_linear.packed_bytes(self.model)
            packed_linear.forget(self.model)
        self.asleep = set(TAGS)
        self.platform.synchronize()
        release_host_memory()
        return released

    def wake(self, tags: list[str] | None) -> int:
        """Restore the given tags (all when None); returns the bytes allocated again."""
        restored = 0
        for tag in tags or TAGS:
            if tag not in self.asleep:
                continue  # waking what is awake is a no-op, as in vLLM
            if tag == "weights":
                for name, p in self._params().items():
                    if name not in self._shapes:
                        continue
                    shape, dtype = self._shapes.pop(name)
                    host = self._host.pop(name, None)
                    p.data = (host.to(p.device) if host is not None
                              else torch.empty(shape, dtype=dtype, device=p.device))
                    restored += p.numel() * p.element_size()
            elif tag == "kv_cache":
                self.kv.allocate()
                restored += self.kv.nbytes
                if self._kv_kept is not None:
                    ids, kept = self._kv_kept
                    self._kv_kept = None
                    self.kv.put_blocks(ids, kept)
                if self._state_kept is not None:
                    conv, rec = self._state_kept
                    self._state_kept = None
                    self.kv.conv_state.copy_(conv)
                    self.kv.rec_state.copy_(rec)
            self.asleep.discard(tag)
        return restored

    def _offload_kv(self, blocks: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A host copy of these blocks of every layer, K and V (workers.kv_cache.KVCache.copy_blocks)."""
        return self.kv.copy_blocks(blocks)

    def zero_weights(self) -> int:
        """/weight_checker reset: zero every parameter in place; all of them count as missing until a full
        update or reload_weights fills them (the packed CPU copies go too). Returns how many."""
        params = self._params()
        for p in params.values():
            p.data.zero_()
        self._discarded = {name: [] for name in params}
        packed_linear.forget(self.model)
        return len(params)

    # --- discarded weights (level 2) ---------------------------------------------------------------

    @property
    def missing(self) -> int:
        """Parameters whose content a level-2 sleep discarded and nothing has written in full since."""
        return len(self._discarded)

    def weights_status(self) -> WeightsStatus:
        """What the worker reports in its acks (the coordinator turns a change into the control state's
        `weights_missing`, which the gateway refuses requests on)."""
        return WeightsStatus(self.missing, len(self._params()))

    def mark_loaded(self, names: list[str] | set[str]) -> int:
        """Checkpoint tensors `names` now hold real values (a committed update, reload_weights): cross off the
        parameters they cover entirely. A parameter fed by several tensors (fused q/k/v, experts) counts once
        all its parts arrived, across updates. Returns how many are still missing."""
        if not self._discarded or "weights" in self.asleep:
            return self.missing
        params = self._params()
        owner = owner_lookup(params)
        for name in names:
            try:
                dst = self.model.weight_destination(name)
            except KeyError:
                continue
            pname = owner(dst)
            if pname not in self._discarded or not dst.is_contiguous():
                continue  # (a strided destination is not tracked: it keeps counting as missing)
            start = dst.storage_offset() - params[pname].storage_offset()
            self._discarded[pname].append((start, start + dst.numel()))
        for pname in [n for n, r in self._discarded.items() if _covers(r, params[n].numel())]:
            del self._discarded[pname]
        return self.missing


def _covers(ranges: list[tuple[int, int]], numel: int) -> bool:
    pos = 0
    for a, b in sorted(ranges):
        if a > pos:
            return False
        pos = max(pos, b)
    return pos >= numel
