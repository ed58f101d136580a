"""An engine restarted whole (its `rollbus serve` killed, then started again by its supervisor) rejoins its
fleet on the fleet's weight version, not the checkpoint's: with --weights-recovery-resume the coordinator's
first control state is the one the copies in --weights-recovery-dir describe (the run that wrote them, how
many updates had committed, the version's label), so every worker restores its copy through the same path a
restarted worker takes (engine.weights.recovery.WeightRecovery.restore), and a worker whose copy is missing,
torn or of another update reports the version lost: 503 naming it until the next full update.

An engine can also miss updates while it is down: the trainer drops it from its list (a fleet update is
refused while an engine does not answer) and updates the others. Its copies then hold an older version than
the fleet serves, and resuming them would put stale weights behind the fleet's router. So every commit of a
fleet update (`/commit_weight_update` with the other engines' URLs, which WeightSyncClient([urls]) sends)
leaves a fleet record beside the copies (FLEET_RECORD: the version, when it committed, the peers; a commit
without peers keeps the last ones), and a
resuming engine first asks those peers (/weight_commit_info): when a peer committed a different version after ours,
the fleet moved on, and the engine fetches that version from a peer that serves it (engine.fleet.catch_up,
--weights-catch-up, on by default) and starts on it; when no peer can send it (or catch-up is off) it starts
on that version as lost (503 naming it, /health 503, until the trainer's next full update), never on its own
older one. No peer answering: it resumes its copies (nothing
says the fleet moved on; the trainer's next update still refuses an engine on another version, naming it).
A new engine joining a fleet (no copies to resume; its peers from --weights-catch-up-peers, or a fleet record
without copies) is behind whatever its peers committed, and takes the same path from its checkpoint.

Reads only the copies' safetensors headers (no torch): the coordinator calls it before anything runs.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.error import URLError
from urllib.request import Request, urlopen

import structlog

from bus.control_state import initial_state
from bus.messages import ControlState
from engine.fleet.catch_up import CatchUpConfig, Own, catch_up, fetch_worker, fleet_peers, joining, newest
from engine.fleet.copy_format import read_header, tag_of

log = structlog.get_logger()

COPY_NAME = re.compile(r"worker-\d+\.safetensors")  # engine.weights.recovery.copy_path's names
FLEET_RECORD = "fleet.json"  # beside the copies: the last fleet update this engine committed
PEER_TIMEOUT_S = 3.0


def copy_tag(path: str) -> dict[str, str] | None:
    """The tag save_copy wrote into a copy's header ({run_id, weight_commits, weight_version}), or None when
    the file is not a readable safetensors file with one."""
    try:
        with open(path, "rb") as f:
            header, _ = read_header(f)
    except (OSError, ValueError):
        return None
    return tag_of(header)


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


@dataclass(frozen=True, slots=True)
class FleetRecord:
    """The last fleet update an engine committed: its version, when (epoch seconds), the other engines."""

    weight_version: str
    committed_at: float
    peers: tuple[str, ...]


def write_fleet_record(folder: str, record: FleetRecord) -> None:
    """After a commit (the gateway): replaces the record atomically."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, FLEET_RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"weight_version": record.weight_version, "committed_at": record.committed_at,
                   "peers": list(record.peers)}, f)
    os.replace(tmp, os.path.join(folder, FLEET_RECORD))


def read_fleet_record(folder: str) -> FleetRecord | None:
    try:
        with open(os.path.join(folder, FLEET_RECORD)) as f:
            raw = json.load(f)
        return FleetRecord(str(raw["weight_version"]), float(raw["committed_at"]),
                           tuple(str(p) for p in raw["peers"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fleet_version(own_version: str, record: FleetRecord | None, answers: list[dict[str, Any] | None]) -> str | None:
    """The version the fleet moved on to while this engine was down, or None (it may resume its own):
    the newest version a peer committed after this engine's last fleet commit, when it is not this engine's.
    `answers` are the peers' /weight_commit_info bodies (None: no answer)."""
    if record is None or record.weight_version != own_version:
        return None  # the copies hold something newer than the record says (a single-engine update since)
    found = newest(own_version, record.committed_at, answers)
    return found[0] if found else None


def ask_peers(peers: tuple[str, ...], timeout_s: float = PEER_TIMEOUT_S,
              api_key: str | None = None) -> list[dict[str, Any] | None]:
    """Each peer's /weight_commit_info, at once; None for a peer that does not answer (or answers nonsense).
    `api_key`: the fleet's --api-key (the peers' weight routes want it, as ours do)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def ask(url: str) -> dict[str, Any] | None:
        try:
            with urlopen(Request(url.rstrip("/") + "/weight_commit_info", headers=headers), timeout=timeout_s) as r:
                body = json.loads(r.read())
            return body if isinstance(body, dict) else None
        except (URLError, OSError, ValueError):
            return None

    if not peers:
        return []
    with ThreadPoolExecutor(len(peers)) as pool:
        return list(pool.map(ask, peers))


def starting_state(run_id: str, folder: str | None, resume: bool, peer_catch_up: CatchUpConfig | None = None,
                   peers: tuple[str, ...] = ()) -> ControlState:
    """The coordinator's first control state: a fresh run on the checkpoint, or (resume) the update the
    recovery copies hold, under that run's id so the workers' restore accepts them; or, when the fleet
    moved on meanwhile, the fleet's version fetched from a peer (`peer_catch_up`: engine.fleet.catch_up) as
    one update past the copies, or, when that fails or is off, the fleet's version as one update past the
    copies that every worker's restore then refuses (the version is lost: 503 naming it until a full update).
    `peers` (--weights-catch-up-peers) are asked beside the fleet record's; an engine without copies to resume
    (a new engine joining the fleet) takes the version its peers committed the same way, never serving its
    checkpoint under the fleet's name."""
    point = resume_point(folder) if resume and folder else None
    record = read_fleet_record(folder) if resume and folder else None
    if point is None:  # the checkpoint, unless the fleet it joins committed a version
        own = joining(run_id, fleet_peers(record.peers if record else (), peers))
        return behind_the_fleet(folder, own, peer_catch_up) or initial_state(run_id)
    old_run, commits, version = point
    resumed = ControlState(run_id=old_run, weight_commits=commits, weight_version=version,
                           version_labels={"0": version})
    if record is not None and record.weight_version == version:  # else: copies newer than the record say
        own = Own(old_run, commits, version, fleet_peers(record.peers, peers), record.committed_at)
        if (state := behind_the_fleet(folder, own, peer_catch_up)) is not None:
            return state
    log.info("coordinator.resuming_weights", folder=folder, version=version, weight_commits=commits, run_id=old_run)
    return resumed


def behind_the_fleet(folder: str | None, own: Own, peer_catch_up: CatchUpConfig | None) -> ControlState | None:
    """When a peer committed a version this engine lacks: that version, fetched from a peer (catch-up) as
    update `own.commits + 1`, else lost (503 naming it); None when nothing says the fleet moved past `own`
    (no peer answers, or none committed anything newer)."""
    if not own.peers:
        return None
    key = peer_catch_up.api_key if peer_catch_up else None
    answers = ask_peers(own.peers, api_key=key)
    found = newest(own.version, own.committed_at, answers)
    if found is None:
        if own.version is None and not any(answers):
            log.warning("coordinator.fleet_peers_silent", peers=list(own.peers),
                        why="no peer answered /weight_commit_info: starting on the checkpoint")
        return None
    moved_on = found[0]
    if peer_catch_up is not None and folder:
        ok, moved_on, at = catch_up(folder, own, answers, peer_catch_up, lambda peers: ask_peers(peers, api_key=key))
        if ok:
            write_fleet_record(folder, FleetRecord(moved_on, at, own.peers))
            return ControlState(run_id=own.run_id, weight_commits=own.commits + 1, weight_version=moved_on,
                                version_labels={"0": moved_on})
    log.error("coordinator.fleet_moved_on", own_version=own.version, fleet_version=moved_on, peers=list(own.peers),
              why="this engine lacks the version its fleet committed (it missed fleet updates while it was down, or "
                  "joins the fleet on its checkpoint) and could not fetch it from a peer; it serves nothing until "
                  "the trainer sends the weights again")
    return ControlState(run_id=own.run_id, weight_commits=own.commits + 1, weight_version=moved_on,
                        version_labels={"0": moved_on})


def known_peers(folder: str, cfg: CatchUpConfig) -> tuple[str, ...]:
    """The fleet's other engines this engine knows: its fleet record's, then --weights-catch-up-peers."""
    record = read_fleet_record(folder)
    return fleet_peers(record.peers if record else (), cfg.peers)


def fetch_own_copy(folder: str, worker: int, state: ControlState, cfg: CatchUpConfig) -> str | None:
    """A worker restarted in a running engine without its copy of the version in service (`state`): that copy
    from a fleet peer (the fleet record's peers and cfg.peers, --weights-catch-up-peers) into `folder`, where
    the worker's restore then finds it (engine.fleet.catch_up.fetch_worker). None when it is there, else why."""
    asked = known_peers(folder, cfg)
    if not asked:
        return "no fleet peers to fetch it from (no fleet record, no --weights-catch-up-peers)"
    answers = ask_peers(asked, api_key=cfg.api_key)
    return fetch_worker(folder, worker, state.run_id, state.weight_commits, state.weight_version, asked, answers, cfg)
