"""Recovery of the weights in service (WeightRecovery, below): copies for a restarted worker: its own recovery copy
(--weights-recovery-dir: written after every committed weight update, `worker-<rank>.safetensors`), or a
copy a live peer wrote on request (ShareWeights). A copy is tagged with the run (ControlState.run_id: a
copy from an earlier run is never taken) and the number of updates committed (ControlState.weight_commits),
and written to a temporary name then renamed, so a worker killed mid-write leaves the previous copy,
which its tag then refuses.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from typing import Any

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bus.messages import ControlReply, ControlRequest, ShareWeights, WeightsLost, WeightsShared
from bus.sockets import send
from engine.fleet.catch_up import CatchUpConfig
from engine.fleet.copy_format import copy_name
from engine.fleet.rejoin import fetch_own_copy, known_peers
from engine.weights.protocol import WeightSyncError

log = structlog.get_logger()


def copy_path(folder: str, rank: int) -> str:
    return os.path.join(folder, copy_name(rank))


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
    try:
        return _load_copy(model, path, run_id, commits)
    except Exception as e:  # noqa: BLE001 - a torn file, another model's shapes: this copy cannot serve
        return f"the recovery copy at {path} could not be loaded: {e}"


def _load_copy(model: torch.nn.Module, path: str, run_id: str, commits: int) -> str | None:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("run_id") != run_id or meta.get("weight_commits") != str(commits):
            return (f"the recovery copy at {path} holds update {meta.get('weight_commits')} of run "
                    f"{meta.get('run_id')}, not update {commits} of this run")
        names = set(f.keys())
        want = set(model.required_weight_names())
        if not want <= names:
            return f"the recovery copy at {path} lacks {len(want - names)} tensors"
        try:
            loaded = model.load_weights(((n, f.get_tensor(n)) for n in sorted(want)), local=True)
        except Exception as e:  # noqa: BLE001 - load_copy says why; a copy fetched at catch-up names its peer
            if source := meta.get("caught_up_from"):
                raise ValueError(f"{e} (fetched from peer {source} at catch-up: not this engine's layout)") from e
            raise
    log.info("worker.weights_recovered", path=path, tensors=len(loaded), weight_commits=commits)
    return None


class WeightRecovery:
    """One worker's hold on the weight version in service, across its restarts: keep a copy after every
    commit (--weights-recovery-dir), restore one at start (its own, else a live peer's: ShareWeights), share
    its own with a restarted peer, and say the version is lost (WeightsLost) when nothing fits. The worker
    actor calls in; `link` is its bus.member.MemberLink (the control state, the DEALER), `sleep` its
    SleepManager."""

    def __init__(self, model: torch.nn.Module, *, folder: str | None, index: int, name: str, donor: str | None,
                 link: Any, sleep: Any, control_timeout_s: float,
                 fleet: CatchUpConfig | None = None) -> None:
        self.model, self.folder, self.index, self.name, self.donor = model, folder, index, name, donor
        self.link, self.sleep, self.control_timeout_s = link, sleep, control_timeout_s
        # --weights-catch-up: without a copy or a donor, a fleet peer engine's copy over HTTP
        # (engine.fleet.rejoin.fetch_own_copy), fetched on a thread that poll() ends
        self.fleet = fleet
        self.fetching: tuple[threading.Thread, list[str | None]] | None = None
        self.weight_commits = 0  # updates whose weights this worker holds (the checkpoint: 0)
        self.weights_lost: str | None = None  # the version in service that this worker could not restore
        self.restoring: tuple[str, str, str, str] | None = None  # asking a peer: (request id, donor, path, why)
        self.update_started_away = False

    def restore(self) -> None:
        """Hold the version in service: the checkpoint when no update committed, else our recovery copy of
        the last update, else a live peer's (ShareWeights); when none fits, the version is lost (reported;
        no step computes meanwhile)."""
        state = self.link.state
        if state.weight_commits == self.weight_commits or self.weights_lost is not None or self.restoring:
            return  # in service already, lost and reported (only a complete update mends it), or on its way
        why = "no --weights-recovery-dir"
        if self.folder:
            why = load_copy(self.model, copy_path(self.folder, self.index), run_id=state.run_id,
                            commits=state.weight_commits)
            if why is None:
                self.weight_commits, self.weights_lost = state.weight_commits, None
                return
        why = (f"{self.name} (re)started after {state.weight_commits} weight update(s) and cannot restore "
               f"version {state.weight_version!r}: {why}")
        if self.donor is not None:
            self._ask_peer(why)
        elif self.folder and self.fleet is not None and known_peers(self.folder, self.fleet):
            self._fetch_from_fleet(why)
        else:
            self.lose(why)

    def _fetch_from_fleet(self, why: str) -> None:
        """Ask the fleet's other engines (HTTP: their recovery copies) for this worker's copy of the version in
        service, on a thread so that this worker keeps answering its bus; poll() loads it. The scheduler gets
        our Hello only after that."""
        state, cfg, folder, index = self.link.state, self.fleet, self.folder, self.index
        result: list[str | None] = []

        def fetch() -> None:
            try:
                result.append(fetch_own_copy(folder, index, state, cfg))
            except Exception as e:  # noqa: BLE001 - a full disk, a bug: the version is lost, said why
                result.append(f"fetching from the fleet failed: {type(e).__name__}: {e}")

        log.info("worker.asking_fleet_for_weights", version=state.weight_version, why=why)
        self.restoring = (uuid.uuid4().hex, "fleet", copy_path(folder, index), why)
        thread = threading.Thread(target=fetch, name=f"{self.name}-fleet-copy", daemon=True)
        self.fetching = (thread, result)
        thread.start()

    def poll(self) -> bool:
        """The fleet peer's copy arrived (or did not): load it, else the version is lost. True when a fetch
        ended (the worker then says Hello to the scheduler)."""
        if self.fetching is None or self.fetching[0].is_alive() or self.restoring is None:
            return False
        (_, result), (_, _, path, why_own) = self.fetching, self.restoring
        self.fetching = self.restoring = None
        state = self.link.state
        why = None
        if self.weight_commits != state.weight_commits:  # (else a complete update reached us meanwhile)
            why = result[0] if result and result[0] is not None else \
                load_copy(self.model, path, run_id=state.run_id, commits=state.weight_commits)
        if why is None:
            self.weight_commits, self.weights_lost = state.weight_commits, None
            log.info("worker.weights_from_fleet", weight_commits=state.weight_commits)
        else:
            self.lose(f"{why_own}; {why}")
        return True

    def _ask_peer(self, why: str) -> None:
        """Ask a live replica (the worker with our tp rank in another engine) for its weights: it writes a
        tagged copy into a private folder of ours (same host), which on_reply loads. The scheduler gets our
        Hello only after that."""
        donor = self.donor
        folder = tempfile.mkdtemp(prefix="rollbus-share-")
        path = os.path.join(folder, f"{self.name}-from-{donor}.safetensors")
        rid = uuid.uuid4().hex
        self.restoring = (rid, donor, path, why)
        log.info("worker.asking_peer_for_weights", donor=donor, version=self.link.state.weight_version)
        timeout = max(self.control_timeout_s, 120.0)
        send(self.link.dealer, ControlRequest(rid, ShareWeights(self.name, donor, path), timeout))

    def on_reply(self, reply: ControlReply) -> bool:
        """The donor's answer: load its copy (or lose the version). True when the reply was ours."""
        if self.restoring is None or reply.request_id != self.restoring[0]:
            return False
        _, donor, path, why_own = self.restoring
        self.restoring = None
        state = self.link.state
        result = reply.results.get(donor)
        if self.weight_commits == state.weight_commits:
            why = None  # a complete update reached us meanwhile: we hold the version in service already
        elif reply.ok and isinstance(result, WeightsShared) and result.path == path:
            why = load_copy(self.model, path, run_id=state.run_id, commits=state.weight_commits)
        else:
            why = f"{donor} could not share its weights: {reply.error or 'no copy'}"
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        if why is None:
            self.weight_commits, self.weights_lost = state.weight_commits, None
            log.info("worker.weights_from_peer", donor=donor, weight_commits=state.weight_commits)
        else:
            self.lose(f"{why_own}; {why}")
        return True

    def share(self, cmd: ShareWeights, away: bool) -> WeightsShared | None:
        """A restarted peer asks for the version in service: write a tagged copy where it said, if that is
        a private folder of this user's made for it (nothing else is written on a bus peer's word)."""
        if cmd.donor != self.name:
            return None
        state = self.link.state
        if self.weights_lost is not None or self.weight_commits != state.weight_commits or away \
                or "weights" in self.sleep.asleep or self.sleep.missing:
            raise WeightSyncError(f"{self.name} does not hold version {state.weight_version!r} either", status=503)
        folder, name = os.path.split(cmd.path)
        st = os.stat(folder) if os.path.isdir(folder) else None
        if not re.fullmatch(r"worker-\d+-from-worker-\d+\.safetensors", name) or \
                not os.path.basename(folder).startswith("rollbus-share-") or st is None or \
                st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise WeightSyncError(f"refusing to write weights to {cmd.path!r}: not a private share folder", status=400)
        t0 = time.perf_counter()
        save_copy(self.model, cmd.path, run_id=state.run_id, commits=state.weight_commits,
                  version=state.weight_version)
        log.info("worker.weights_shared", member=cmd.member, seconds=round(time.perf_counter() - t0, 3))
        return WeightsShared(cmd.path)

    def lose(self, why: str) -> None:
        state = self.link.state
        self.weights_lost = state.weight_version
        log.error("worker.weight_version_lost", version=state.weight_version, why=why)
        send(self.link.dealer, ControlRequest(uuid.uuid4().hex, WeightsLost(state.weight_version, state.weight_epoch,
                                                                            self.name, why), 0.0))

    def committed(self, committed: bool, received: list[str], away: bool) -> None:
        """An update committed on the engine: hold it (and keep a copy), or say that we missed it."""
        started_away, self.update_started_away = self.update_started_away, False
        state = self.link.state
        if not committed or away or started_away:
            # the others finished an update we did not (we were stalled, declared lost, while it ran)
            self.lose(f"{self.name} missed weight update {state.weight_commits} (it was not in the "
                      "engine while the update ran)")
        elif self.weights_lost is not None and not set(self.model.required_weight_names()) <= set(received):
            # a partial update on top of weights we do not have is still not the version in service
            self.lose(f"{self.name} lost the weights before this update, which sent only "
                      f"{len(set(received))} of the model's tensors: send every tensor")
        else:
            self.weights_lost = None
            self.weight_commits = state.weight_commits
            self.keep()

    def keep(self) -> None:
        """--weights-recovery-dir: the weights now in service, for a restart of this worker."""
        if not self.folder or "weights" in self.sleep.asleep or self.sleep.missing:
            return
        state = self.link.state
        t0 = time.perf_counter()
        path = save_copy(self.model, copy_path(self.folder, self.index), run_id=state.run_id,
                         commits=state.weight_commits, version=state.weight_version)
        log.info("worker.weights_copy_kept", path=path, weight_commits=state.weight_commits,
                 seconds=round(time.perf_counter() - t0, 3))
