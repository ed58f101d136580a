"""The tensor-parallel group of one engine: its workers, one per device, joined by torch.distributed.

Backend by platform (ascend_ops.platform): Gloo on CPU, NCCL on CUDA, HCCL on NPU. Rendezvous: tp rank 0
hosts a TCPStore on ``--master-addr:--master-port`` (vLLM's flags and defaults, 127.0.0.1:29501; an engine
of data-parallel rank i uses port + i), the other ranks connect to it; ``--distributed-timeout-seconds``
bounds the rendezvous and every collective (default 600 s).

The model calls only what Megatron-style sharding needs: ``all_reduce`` (sum; after the row-parallel O and
down projections and the vocabulary-parallel embedding), ``gather`` (the vocabulary-parallel LM head's
logits to rank 0, which samples), ``broadcast`` (rank 0's sampled tokens) and ``any`` (a flag every rank
contributes: a step some rank cannot run, an abort pause seen between layers). ``SOLO`` is the group of
one (``-tp 1``): every call returns its input and nothing is imported or initialised.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501  # vLLM's --master-port default
DEFAULT_TIMEOUT_S = 600.0


class TPError(RuntimeError):
    """The group could not be formed, or a collective failed (a peer died): the worker cannot go on."""


class Solo:
    """One worker: no communication at all."""

    rank, size = 0, 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        return [t]

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def any(self, flag: bool) -> bool:
        return flag

    def destroy(self) -> None:
        pass


SOLO = Solo()


class Layout(Solo):
    """Rank `rank` of `size` without a group: to build one rank's shard layout offline (on the meta device,
    say, to compute what each rank holds); its collectives do nothing."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


class TPGroup(Solo):
    """``size`` workers of one engine; ``rank`` is this worker's tp rank."""

    def __init__(self, rank: int, size: int, *, addr: str, port: int, timeout_s: float, device: torch.device,
                 backend: str):
        import torch.distributed as dist

        self.rank, self.size, self.device, self.backend = rank, size, device, backend
        self.what = f"tp rank {rank} of {size} ({backend}) at {addr}:{port}"
        self._dist = dist
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type != "cpu":  # NCCL / HCCL bind the communicator to the current device
            getattr(torch, device.type).set_device(device)
        try:
            store = dist.TCPStore(addr, port, size, rank == 0, timeout=timeout, wait_for_workers=True)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - torch raises several types; all mean "no group"
            raise TPError(f"tensor-parallel rendezvous failed ({self.what}): {type(e).__name__}: {e}") from None
        self._store = store
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)

    def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - a peer died or timed out: the group is unusable
            raise TPError(f"tensor-parallel collective {fn.__name__} failed ({self.what}): {e}") from None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._run(self._dist.all_reduce, t)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None on the others."""
        t = t.contiguous()
        if self.backend == "gloo":
            parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
            self._run(self._dist.gather, t, parts, dst=0)
            return parts
        # NCCL and HCCL gather through all_gather (their point-to-point gather is not always there)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run(self._dist.all_gather, parts, t)
        return parts if self.rank == 0 else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (a host tensor travels through the device on NCCL / HCCL)."""
        if t.device == self.device:
            self._run(self._dist.broadcast, t, 0)
            return t
        on = t.to(self.device)
        self._run(self._dist.broadcast, on, 0)
        return on.to(t.device)

    def any(self, flag: bool) -> bool:
        self._flag.fill_(int(flag))
        self._run(self._dist.all_reduce, self._flag, op=self._dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def destroy(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - at exit, a peer may be gone already
            pass


def init_tp_group(rank: int, size: int, device: torch.device, *, addr: str = DEFAULT_MASTER_ADDR,
                  port: int = DEFAULT_MASTER_PORT, timeout_s: float | None = None) -> Solo:
    """SOLO for size 1; otherwise join (rank 0: host) the engine's group. Raises TPError."""
    if size == 1:
        return SOLO
    from ascend_ops.platform import current_platform

    return TPGroup(rank, size, addr=addr, port=port, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, device=device,
                   backend=current_platform().dist_backend)
