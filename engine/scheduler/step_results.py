"""The steps in flight and their results: each step sent and not answered yet (one, or two with async
scheduling), the results each worker rank sent for it (one tp worker may answer the next step before another
answers this one), handed back oldest first once every rank's is in; and what a step's requests are told when
it failed. Pure: the actor (engine.scheduler.actor) receives the results and applies the steps."""

from __future__ import annotations

from collections import deque

from bus.messages import ErrorInfo, ErrorKind, StepResult
from engine.scheduler.policy import ScheduledStep


class InFlight:
    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        # Steps sent and not answered yet, oldest first: (step id, step, when it was sent)
        self.steps: deque[tuple[int, ScheduledStep, float]] = deque()
        self.results: dict[int, dict[int, StepResult]] = {}  # step id -> rank -> its result

    def __len__(self) -> int:
        return len(self.steps)

    def sent(self, step_id: int, step: ScheduledStep, at: float) -> None:
        self.steps.append((step_id, step, at))

    def step(self, step_id: int) -> ScheduledStep | None:
        """The step in flight with this id; None for a step failed or forgotten (a worker was lost)."""
        return next((st for sid, st, _ in self.steps if sid == step_id), None)

    def add(self, res: StepResult) -> None:
        """One rank's result, kept until its step's turn."""
        self.results.setdefault(res.step_id, {})[res.rank] = res

    def oldest_answered(self) -> bool:
        """Every rank's result of the oldest step in flight is in."""
        return bool(self.steps) and len(self.results.get(self.steps[0][0], ())) == self.num_workers

    def pop(self) -> tuple[ScheduledStep, float, dict[int, StepResult]]:
        """The oldest step (answered: oldest_answered()), when it was sent, and its results by rank."""
        step_id, step, sent = self.steps.popleft()
        return step, sent, self.results.pop(step_id)

    def clear(self) -> None:
        self.steps.clear()
        self.results = {}


def step_error(results: dict[int, StepResult]) -> ErrorInfo | None:
    """What the requests of a step some worker failed are told (None: no worker failed it): the failing
    worker's own error (tp peers that only declined the step say TensorParallelPeer), through step_failure."""
    errors = sorted((r.error for r in results.values() if r.error is not None),
                    key=lambda e: e.kind == ErrorKind.TP_PEER)
    return step_failure(errors[0]) if errors else None


def step_failure(e: ErrorInfo) -> ErrorInfo:
    """What the requests of a failed step are told: a failure the worker anticipated (it knows the HTTP
    status, e.g. 503 for weights a level-2 sleep discarded) as it is; anything else as a 500 that names
    the exception."""
    if e.status is not None:
        return ErrorInfo(e.kind, e.message, e.member, e.status, e.param, e.tensor)
    return ErrorInfo(ErrorKind.STEP_FAILED, f"worker step failed: {e.kind}: {e.message}", e.member, None, e.param,
                     e.tensor)
