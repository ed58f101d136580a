"""The weight-update lifecycle, written once: pause modes, every step's deadline, the step sequence and the
abort rule (all or nothing). Pure: no sockets. The HTTP routes (gateway/weight_routes.py) take one step per
call from `Deadlines` and apply `abort_needed`; the coordinator runs `sync_steps` for a bus-driven update
(WeightUpdateEvent); the trainer client checks its pause mode against PAUSE_MODES.

    pause (unless mode "none") -> start_weight_update -> update_weights x N -> finish_weight_update
      -> commit_weight_update (new epoch and label: every worker has the update) -> resume

A failure at start, update or finish broadcasts abort_weight_update (the workers drop what they staged:
the previous weights stay in service) and then resume, so the engine never stays paused or half-updated
because a trainer went wrong.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from bus.messages import (
    UPDATE_ACTIVE,
    AbortWeightUpdate,
    CommandBody,
    CommitWeightUpdate,
    ErrorInfo,
    FinishWeightUpdate,
    Pause,
    Resume,
    StartWeightUpdate,
    UpdateWeights,
    command_name,
)

PAUSE_MODES = ("abort", "wait", "keep")  # /pause, /sleep, and the pause around a weight update
UPDATE_PAUSE_MODES = (*PAUSE_MODES, "none")  # a weight update may also run without pausing
WAIT_DEADLINE_S = 3600.0  # a "wait" pause lasts as long as the longest running request: a generous deadline
DEFAULT_TRANSFER_TIMEOUT_S = 300.0  # --weight-transfer-config timeout_s


def pause_deadline(mode: str, control_timeout_s: float) -> float:
    return WAIT_DEADLINE_S if mode == "wait" else control_timeout_s


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Each step of an update with its deadline: control steps take control_s, a pause in "wait" mode
    WAIT_DEADLINE_S, a transfer (and a rendezvous) its own timeout on top of control_s."""

    control_s: float
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    @property
    def transfer_s(self) -> float:
        return self.transfer_timeout_s + self.control_s

    def __call__(self, command: CommandBody) -> Step:
        if isinstance(command, Pause):
            return Step(command, pause_deadline(command.mode, self.control_s))
        return Step(command, self.transfer_s if isinstance(command, UpdateWeights) else self.control_s)


def abort_needed(command: CommandBody, status: int, errors: list[ErrorInfo]) -> bool:
    """All or nothing, for a step a caller drives (HTTP): when one worker fails a step of the update, every
    worker drops the update. A failed start too (a worker refused it, e.g. its weights are asleep): its
    broadcast opened the update window, which would hold every step. Not aborted: the coordinator's refusal
    of a start while another update is active (nothing was broadcast), and a 409 mid-update (none is
    active). `sync_steps` aborts after any failure: it owns the window it opened."""
    if any(e.kind == UPDATE_ACTIVE for e in errors):
        return False
    return isinstance(command, StartWeightUpdate) or status != 409


@dataclass(frozen=True, slots=True)
class Step:
    command: CommandBody
    timeout_s: float

    @property
    def name(self) -> str:
        return command_name(self.command)


@dataclass(slots=True)
class StepReply:
    ok: bool
    error: str = ""
    status: int = 200  # the HTTP status of the failure (4xx from validation, 409 state, 504 timeout)
    results: dict[str, Any] = field(default_factory=dict)
    errors: list[ErrorInfo] = field(default_factory=list)  # one per failing member


@dataclass(slots=True)
class SyncOutcome:
    ok: bool
    error: str = ""
    status: int = 200
    failed_step: str = ""
    errors: list[ErrorInfo] = field(default_factory=list)

    def error_info(self) -> ErrorInfo | None:
        """The failure as it travels (WeightUpdateResult.error): the failing step and every member's error in
        the message, their first member's kind and field, and the HTTP status."""
        if self.ok:
            return None
        first = self.errors[0] if self.errors else None
        kind = first.kind if first else ("Timeout" if self.status == 504 else "WeightSyncError")
        message = f"{self.failed_step} failed: {self.error}" if self.failed_step else self.error
        return ErrorInfo(kind, message, "", self.status, first and first.param, first and first.tensor)


def sync_steps(version: str, pause_mode: str, clear_cache: bool, updates: list[dict[str, Any]],
               control_timeout_s: float, transfer_timeout_s: float,
               ) -> Generator[Step, StepReply, SyncOutcome]:
    """The coordinator's driver of a bus-driven update: yields each step, is sent its reply. transfer_timeout_s
    is the whole deadline of an update_weights step."""
    d = Deadlines(control_timeout_s, transfer_timeout_s - control_timeout_s)
    paused = pause_mode != "none"
    if paused:
        r = yield d(Pause(pause_mode, clear_cache))
        if not r.ok:
            return SyncOutcome(False, r.error, r.status, "pause", r.errors)
    steps = [StartWeightUpdate(), *map(UpdateWeights, updates), FinishWeightUpdate()]
    for command in steps:
        r = yield d(command)
        if not r.ok:
            break
    # a failed start is aborted too: it reached the workers and opened the window (the coordinator refuses
    # a start while another update is active before this generator runs)
    yield d(CommitWeightUpdate(version) if r.ok else AbortWeightUpdate())
    if paused:
        yield d(Resume())
    return SyncOutcome(True) if r.ok else SyncOutcome(False, r.error, r.status, command_name(command), r.errors)


def reply_status(ok: bool, missing: list[str], errors: list[ErrorInfo]) -> int:
    """The HTTP status of an acked broadcast: 504 when someone did not ack, else the highest status a
    failing member reported (500 when none said)."""
    if ok:
        return 200
    if missing:
        return 504
    return max((e.status for e in errors if e.status is not None), default=500)
