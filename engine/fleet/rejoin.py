"""An engine restarted whole (its `rollbus serve` killed, then started again by its supervisor) rejoins its
fleet on the fleet's weight version, not the checkpoint's: with --weights-recovery-resume the coordinator's
first control state is the one the copies in --weights-recovery-dir describe (the run that wrote them, how
many updates had committed, the version's label), so every worker restores its copy through the same path a
restarted worker takes (engine.weights.recovery.WeightRecovery.restore), and a worker whose copy is missing,
torn or of another update reports the version lost: 503 naming it until the next full update.

Reads only the copies' safetensors headers (no torch): the coordinator calls it before anything runs.
"""

from __future__ import annotations

import json
import os
import re
import struct

import structlog

from bus.control_state import initial_state
from bus.messages import ControlState

log = structlog.get_logger()

COPY_NAME = re.compile(r"worker-\d+\.safetensors")  # engine.weights.recovery.copy_path's names
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def copy_tag(path: str) -> dict[str, str] | None:
    """The tag save_copy wrote into a copy's header ({run_id, weight_commits, weight_version}), or None when
    the file is not a readable safetensors file with one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in
                                             ("run_id", "weight_commits", "weight_version")):
        return None
    if not meta["weight_commits"].isdigit() or not meta["run_id"]:
        return None
    return meta


def resume_point(folder: str) -> tuple[str, int, str] | None:
    """(run id, updates committed, version label) of the newest update any worker's copy in `folder` holds,
    or None when there is none to resume (no folder, no copies, only the checkpoint's). Copies of other
    updates or runs stay where they are: their workers' restore refuses them and reports the version lost."""
    try:
        names = [n for n in os.listdir(folder) if COPY_NAME.fullmatch(n)]
    except OSError:
        return None
    best: tuple[int, float, str, str] | None = None
    for name in names:
        path = os.path.join(folder, name)
        tag = copy_tag(path)
        if tag is None:
            log.warning("coordinator.recovery_copy_unreadable", path=path)
            continue
        key = (int(tag["weight_commits"]), os.path.getmtime(path), tag["run_id"], tag["weight_version"])
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None or best[0] == 0:
        return None
    commits, _, run_id, version = best
    return run_id, commits, version


def starting_state(run_id: str, folder: str | None, resume: bool) -> ControlState:
    """The coordinator's first control state: a fresh run on the checkpoint, or (resume) the update the
    recovery copies hold, under that run's id so the workers' restore accepts them."""
    point = resume_point(folder) if resume and folder else None
    if point is None:
        return initial_state(run_id)
    old_run, commits, version = point
    log.info("coordinator.resuming_weights", folder=folder, version=version, weight_commits=commits, run_id=old_run)
    return ControlState(run_id=old_run, weight_commits=commits, weight_version=version,
                        version_labels={"0": version})
