"""Transfer backends: how a trainer's bytes reach the workers. Each backend is one module with both halves,
a `Sender` (the trainer client's) and a `Receiver` (a worker's), and one pair of payload structs (vLLM's
init_info / update_info, bus.messages): ipc (engine.weights.ipc_backend) and collective over NCCL / HCCL /
Gloo (engine.weights.collective_backend). This registry is the only place that maps a backend name to its
code; everything else goes through these two base classes. Torch-free: the gateway reads PAYLOADS.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from bus.messages import CollectiveInitInfo, CollectiveUpdateInfo, IpcInitInfo, IpcUpdateInfo

if TYPE_CHECKING:

    from engine.weights.protocol import ParamMeta

# canonical name -> (module, init_info struct, update_info struct); config.BACKENDS maps the aliases
REGISTRY = {"ipc": ("engine.weights.ipc_backend", IpcInitInfo, IpcUpdateInfo),
            "hccl": ("engine.weights.collective_backend", CollectiveInitInfo, CollectiveUpdateInfo)}


def init_struct(backend: str) -> type:
    return REGISTRY[backend][1]


def update_struct(backend: str) -> type:
    return REGISTRY[backend][2]


class Receiver:
    """A worker's half; engine.weights.receiver.WeightReceiver (`r`) owns the state machine, validation
    against the model and staging, and calls these with decoded, edge-checked payloads. The defaults suit a
    backend with nothing to join, hold or drain."""

    def init(self, info: Any, r: Any) -> None:  # init_info: join / prepare
        pass

    def check_start(self) -> None:  # WeightSyncError (409) when an update cannot start
        pass

    def update(self, info: Any, r: Any) -> tuple[int, int]:  # one update_weights call: (tensors, bytes)
        raise NotImplementedError

    def drain(self, wire: CollectiveUpdateInfo | None, r: Any) -> str:  # a refused call: a note for its error
        return ""

    def release(self) -> int:  # sleep: bytes of receive buffers freed
        return 0

    def release_group(self) -> bool:  # sleep_mode_extra_cleanup: whether a group was torn down
        return False

    def shutdown(self) -> None:
        pass


class Sender:
    """The trainer client's half (engine.trainer.client.WeightSyncClient, `self.c`)."""

    ONE_ENGINE: bool  # shares memory with one engine: no fleet
    SHARE_MEMORY_PACKED: bool  # the packed setting that share_memory=True works with

    def __init__(self, client: Any) -> None:
        self.c = client

    def prepare(self, named: Any) -> Any:  # the (name, tensor) pairs to send (ipc may share them)
        return named

    def ensure_ready(self) -> None:  # before a send: form what the backend needs once
        pass

    def init_transfer(self) -> None:  # /init_weight_transfer_engine
        raise NotImplementedError

    def restart(self, status: int, param: str | None) -> bool:  # a refused start this backend can mend
        return False

    def transfer(self, tensors: Any, metas: list[ParamMeta]) -> None:  # the HTTP path's update_weights calls
        raise NotImplementedError

    def bus_updates(self, tensors: Any, metas: list[ParamMeta]) -> list[Any]:  # WeightUpdateEvent.updates
        raise NotImplementedError

    def after_announce(self, tensors: Any, metas: list[ParamMeta]) -> None:  # the bus path, once announced
        pass

    def close(self) -> None:
        pass


def receiver(backend: str) -> Receiver:
    return import_module(REGISTRY[backend][0]).Receiver()


def sender(backend: str, client: Any) -> Sender:
    return import_module(REGISTRY[backend][0]).Sender(client)
