"""Copies of the weights in service, for a restarted worker: its own recovery copy
(--weights-recovery-dir: written after every committed weight update, `worker-<rank>.safetensors`), or a
copy a live peer wrote on request (ShareWeights). A copy is tagged with the run (ControlState.run_id: a
copy from an earlier run is never taken) and the number of updates committed (ControlState.weight_commits),
and written to a temporary name then renamed, so a worker killed mid-write leaves the previous copy,
which its tag then refuses.
"""

from __future__ import annotations

import os

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = structlog.get_logger()


def copy_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"worker-{rank}.safetensors")


def save_copy(model: torch.nn.Module, path: str, *, run_id: str, commits: int, version: str) -> str:
    """The model's tensors under the names a trainer sends (HF names), tagged; returns the path. A tp worker
    writes its own part of each (load_copy loads it back as it is)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tensors = {n: model.weight_destination(n).detach().to("cpu").contiguous()
               for n in sorted(model.required_weight_names())}
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"run_id": run_id, "weight_commits": str(commits), "weight_version": version})
    os.replace(tmp, path)
    return path


def load_copy(model: torch.nn.Module, path: str, *, run_id: str, commits: int) -> str | None:
    """Fill the model from the copy at `path` when its tag is (run_id, commits). Returns None on success,
    else why it could not (no copy, another run's or update's copy, tensors missing)."""
    if not os.path.exists(path):
        return f"no recovery copy at {path}"
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("run_id") != run_id or meta.get("weight_commits") != str(commits):
            return (f"the recovery copy at {path} holds update {meta.get('weight_commits')} of run "
                    f"{meta.get('run_id')}, not update {commits} of this run")
        names = set(f.keys())
        want = set(model.required_weight_names())
        if not want <= names:
            return f"the recovery copy at {path} lacks {len(want - names)} tensors"
        loaded = model.load_weights(((n, f.get_tensor(n)) for n in sorted(want)), local=True)
    log.info("worker.weights_recovered", path=path, tensors=len(loaded), weight_commits=commits)
    return None
