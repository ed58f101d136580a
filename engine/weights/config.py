"""`--weight-transfer-config`: which backend moves a trainer's weights into the workers. Pure.

    {"backend": "ipc"}    same device as the trainer: CUDA IPC, NPU IPC (torch_npu), shared memory on CPU
    {"backend": "hccl"}   separate devices: vLLM's collective protocol (StatelessProcessGroup rendezvous, then
                          HCCL on NPU / NCCL on CUDA as vLLM's PyHccl/PyNccl communicators, Gloo on CPU)

Aliases: npu_ipc -> ipc; nccl and gloo -> hccl (the platform picks the collective library, so every name
works on every platform). Without "backend" (`'{}'`) the platform's collective is the default, as vLLM
defaults to nccl: nccl on CUDA, hccl on NPU, gloo on CPU. Optional keys beyond vLLM's:

    stage_updates  (default true)  write an update into a second copy of the touched weights and swap it in
                                   when every worker has finished: a failed update leaves the previous
                                   weights in service, bit for bit. Costs one extra copy of the updated
                                   weights in device memory while the transfer engine is initialised.
                                   false: write in place (no extra memory; a failure midway leaves the
                                   weights mixed until the next complete update).
    timeout_s      (default 300)   deadline for a collective rendezvous and for each transfer call.
    pause_mode     (default keep)  how the coordinator pauses generation for an update announced on the
                                   bus (WeightUpdateEvent) that does not say: abort | wait | keep | none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.argv import json_object_flag
from engine.weights.lifecycle import DEFAULT_TRANSFER_TIMEOUT_S, UPDATE_PAUSE_MODES

BACKENDS = {"ipc": "ipc", "npu_ipc": "ipc", "hccl": "hccl", "nccl": "hccl", "gloo": "hccl"}
_KEYS = {"backend", "stage_updates", "timeout_s", "pause_mode"}


@dataclass(frozen=True, slots=True)
class WeightTransferConfig:
    backend: str  # canonical: ipc | hccl
    name: str  # as the user wrote it
    stage_updates: bool = True
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    pause_mode: str = "keep"

    def effective(self) -> dict:
        return asdict(self)


def default_backend() -> str:
    """vLLM's default backend is nccl (its only collective); ours is the platform's collective library."""
    return {"cuda": "nccl", "npu": "hccl"}.get(platform_name(), "gloo")


def platform_name() -> str:
    """The workers' platform ("cpu" without importing torch on a CPU-only host). engine.launcher's
    launcher_platform asks the same, but an entry point sits above this floor (.ci/check_imports.py)."""
    from ascend_ops.host_env import cpu_only_host

    if cpu_only_host():
        return "cpu"
    from ascend_ops.platform import current_platform

    return current_platform().name


def parse_weight_transfer_config(text: str | None) -> WeightTransferConfig | None:
    """None when the flag is absent; ValueError (a start-up error) for anything invalid."""
    raw = json_object_flag("--weight-transfer-config", text, _KEYS, '{"backend": "ipc"}')
    if raw is None:
        return None
    name = raw.get("backend", None) if "backend" in raw else default_backend()
    if name not in BACKENDS:
        raise ValueError(f"Invalid weight transfer backend: {name}. Available engines: {sorted(BACKENDS)}")
    stage = raw.get("stage_updates", True)
    if not isinstance(stage, bool):
        raise ValueError(f"--weight-transfer-config: stage_updates must be true or false, got {stage!r}")
    timeout = raw.get("timeout_s", DEFAULT_TRANSFER_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"--weight-transfer-config: timeout_s must be a positive number, got {timeout!r}")
    pause = raw.get("pause_mode", "keep")
    if pause not in UPDATE_PAUSE_MODES:
        raise ValueError(f"--weight-transfer-config: pause_mode must be one of {', '.join(UPDATE_PAUSE_MODES)}, "
                         f"got {pause!r}")
    return WeightTransferConfig(BACKENDS[name], name, stage, float(timeout), pause)
