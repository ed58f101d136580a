"""Which of the scheduler's workers are lost and not back (docs/architecture.md "Recovery"). A worker is back
once it has said Hello on the results socket at or after the seq of its loss and is subscribed to the plans
again (a restarted one subscribes anew); until every lost worker is back the scheduler does not step, and
queued requests fail after RECOVERY_WAIT_S. Pure: the actor (engine.scheduler.actor) reports the losses,
Hellos and subscriptions it sees."""

from __future__ import annotations

import time

import structlog

from bus.messages import Hello, WorkerInfo

log = structlog.get_logger()

RECOVERY_WAIT_S = 60.0  # how long queued requests wait for a lost worker to come back before failing (503)


class WorkerRecovery:
    def __init__(self) -> None:
        self.waiting: dict[str, int] = {}  # workers lost and not back: name -> seq of the loss
        self.since = 0.0  # when the first of them was lost
        self.hellos: dict[str, int] = {}  # each worker's last Hello: name -> the seq it joined at
        self.plan_subs: set[str] = set()  # who is subscribed to the plans

    def lost(self, names: list[str], seq: int) -> None:
        if not self.waiting:
            self.since = time.monotonic()
        for n in names:
            self.waiting[n] = seq

    def on_plan_subscription(self, on: bool, name: str | None) -> None:
        if name is None:
            return
        if on:
            self.plan_subs.add(name)
            self.check_rejoined(name)
        else:
            self.plan_subs.discard(name)

    def on_worker_hello(self, h: Hello) -> None:
        self.hellos[h.name] = h.info.joined_seq if isinstance(h.info, WorkerInfo) else 0
        self.check_rejoined(h.name)

    def check_rejoined(self, name: str) -> None:
        lost_at = self.waiting.get(name)
        if lost_at is None or self.hellos.get(name, -1) < lost_at or name not in self.plan_subs:
            return
        del self.waiting[name]
        log.info("scheduler.worker_rejoined", worker=name, waiting_for=sorted(self.waiting),
                 after_s=round(time.monotonic() - self.since, 2))

    def waited_too_long(self) -> bool:
        """Lost workers are waited for, and have been past RECOVERY_WAIT_S."""
        return bool(self.waiting) and time.monotonic() - self.since > RECOVERY_WAIT_S

    def message(self) -> str:
        return (f"{', '.join(sorted(self.waiting))} did not come back within {RECOVERY_WAIT_S:.0f}s "
                "of being lost")
