"""The scheduler's step bookkeeping, read by /metrics and the benchmarks through every OutputBatch's stats:
how long steps take (wall and the workers' own compute), the scheduler's turnaround between a step's results
and the next plan (the time the workers wait on us), and the token counters. Pure: the actor
(engine.scheduler.actor) calls it as steps are sent and answered."""

from __future__ import annotations

import time
from collections import defaultdict

from engine.scheduler.policy import Scheduler


class StepMetrics:
    def __init__(self) -> None:
        self.last_done = 0.0  # when the previous step's results were all in (a queued step starts then)
        self.results_at = 0.0  # when the last step's results were all in (0: consumed by the next plan)
        self.results_cpu = 0.0  # this thread's CPU time then: turnaround_cpu_total is what we spent of it
        self.step_time_ema = 0.0
        self.counters = defaultdict(float)

    def results_in(self, sent: float, arrived: float, cpu: float, *, idle: bool) -> float:
        """A step's results are all in (at `arrived`, this thread's CPU time `cpu`); `idle`: nothing else is in
        flight, so the workers wait for the next plan from now. Returns when the step started: a queued step
        started when the one before ended."""
        started, self.last_done = max(sent, self.last_done), arrived
        if idle:  # the workers wait for the next plan from now: turnaround
            self.results_at, self.results_cpu = arrived, cpu
        return started

    def step_done(self, started: float, compute_s: float) -> None:
        """A step that ran (not failed, not interrupted): its wall time since `started`, and the worker's own."""
        dt = time.perf_counter() - started
        self.step_time_ema = dt if not self.step_time_ema else 0.9 * self.step_time_ema + 0.1 * dt
        self.counters["steps"] += 1
        self.counters["step_time_total"] += dt
        # the worker's own compute time: step_time_total - step_compute_total is what the bus hop costs
        self.counters["step_compute_total"] += compute_s

    def plan_sent(self) -> None:
        if self.results_at:  # set only when the results left nothing in flight: the workers wait for this plan
            # the scheduler's own time between a step's results and the next plan (the workers wait)
            self.counters["turnaround_total"] += time.perf_counter() - self.results_at
            self.counters["turnaround_cpu_total"] += time.thread_time() - self.results_cpu
            self.counters["turnarounds"] += 1
            self.results_at = 0.0

    def no_plan_followed(self) -> None:
        """The loop turn ends without a plan after the results: idle time is not turnaround."""
        self.results_at = 0.0

    def stats(self, sched: Scheduler) -> dict[str, float]:
        b = sched.blocks
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_usage": b.usage, "step_time_s": self.step_time_ema,
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_queries": b.num_prefix_queries, "prefix_cache_hits": b.num_prefix_hits,
                **self.counters}
