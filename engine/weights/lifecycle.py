"""The sequence of acked broadcasts that applies one weight version, and what happens when a step fails.
Pure: a generator that yields the commands to broadcast and is sent each reply; the coordinator runs it
for bus-driven updates (WeightUpdateEvent).

    pause (unless mode "none") -> start_weight_update -> update_weights x N -> finish_weight_update
      -> commit_weight_update (new epoch and label: every worker has the update) -> resume

A failure at start, update or finish broadcasts abort_weight_update (the workers drop what they staged:
the previous weights stay in service) and then resume, so the engine never stays paused or half-updated
because a trainer went wrong. The HTTP routes (gateway/weight_routes.py) apply the same rule call by call.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from bus.messages import (
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
    paused = pause_mode != "none"
    if paused:
        deadline = 3600.0 if pause_mode == "wait" else control_timeout_s
        r = yield Step(Pause(pause_mode, clear_cache), deadline)
        if not r.ok:
            return SyncOutcome(False, r.error, r.status, "pause", r.errors)
    failed: tuple[str, StepReply] | None = None
    r = yield Step(StartWeightUpdate(), control_timeout_s)
    if not r.ok:
        failed = ("start_weight_update", r)
    else:
        for info in updates:
            r = yield Step(UpdateWeights(info), transfer_timeout_s)
            if not r.ok:
                failed = ("update_weights", r)
                break
        else:
            r = yield Step(FinishWeightUpdate(), control_timeout_s)
            if not r.ok:
                failed = ("finish_weight_update", r)
    if failed is None:
        yield Step(CommitWeightUpdate(version), control_timeout_s)
    else:  # a failed start too: it reached the workers and opened the window (the coordinator
        # refuses a start while another update is active before this generator runs)
        yield Step(AbortWeightUpdate(), control_timeout_s)
    if paused:
        yield Step(Resume(), control_timeout_s)
    if failed is not None:
        step, r = failed
        return SyncOutcome(False, r.error, r.status, step, r.errors)
    return SyncOutcome(True)


def reply_status(ok: bool, missing: list[str], errors: list[ErrorInfo]) -> int:
    """The HTTP status of an acked broadcast: 504 when someone did not ack, else the highest status a
    failing member reported (500 when none said)."""
    if ok:
        return 200
    if missing:
        return 504
    return max((e.status for e in errors if e.status is not None), default=500)
