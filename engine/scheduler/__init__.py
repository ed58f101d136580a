"""The scheduler process: policy.py (which sequences run each step: pure) with chunk_limits.py (how much of a
step prefill chunks take: pure), step_gate.py (whether a step may run at all: a pure state machine over the
control commands), actor.py (the sockets around them), and the actor's pure helpers: admission.py,
result_check.py, step_plan.py, step_results.py, outputs.py, routed_pieces.py, step_metrics.py, recovery.py."""

from engine.scheduler.policy import ScheduledStep, Scheduler, SeqUpdate

__all__ = ["ScheduledStep", "Scheduler", "SeqUpdate"]
