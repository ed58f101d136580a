"""Transfer backends: how a trainer's bytes reach the workers. Each backend is one module with both halves,
a `Sender` (the trainer client's) and a `Receiver` (a worker's): ipc (engine.weights.ipc_backend) and
collective over NCCL / HCCL / Gloo (engine.weights.collective_backend). This registry is the only place
that maps a backend name to its code; everything else goes through these two protocols.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Protocol

import torch

from engine.weights.protocol import ParamMeta

_MODULES = {"ipc": "engine.weights.ipc_backend", "hccl": "engine.weights.collective_backend"}  # canonical names


class Receiver(Protocol):
    """A worker's half; engine.weights.receiver.WeightReceiver (`r`) owns the state machine, validation
    against the model and staging, and calls these."""

    def init(self, info: dict[str, Any], r: Any) -> None: ...  # init_info: join / prepare
    def check_start(self) -> None: ...  # WeightSyncError (409) when an update cannot start
    def update(self, info: dict[str, Any], r: Any) -> dict[str, Any]: ...  # one update_weights call
    def release(self) -> int: ...  # sleep: bytes of receive buffers freed
    def release_group(self) -> bool: ...  # sleep_mode_extra_cleanup
    def shutdown(self) -> None: ...


class Sender(Protocol):
    """The trainer client's half (engine.trainer.client.WeightSyncClient)."""

    def prepare(self, named: Any) -> Any: ...  # the (name, tensor) pairs to send (ipc may share them)
    def ensure_ready(self) -> None: ...  # before a send: form what the backend needs once
    def init_transfer(self) -> None: ...  # /init_weight_transfer_engine
    def restart(self, status: int, param: str | None) -> bool: ...  # a refused start this backend can mend
    def transfer(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None: ...  # HTTP
    def bus_updates(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> list[dict]: ...
    def after_announce(self, tensors: list[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> None: ...
    def close(self) -> None: ...


def receiver(backend: str) -> Receiver:
    return import_module(_MODULES[backend]).Receiver()


def sender(backend: str, client: Any) -> Sender:
    return import_module(_MODULES[backend]).Sender(client)
