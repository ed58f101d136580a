"""The StepPlan the workers run for one scheduled step (bus.messages): the sequences new to them, every
sequence's position, new tokens and block table, and, where the model has them, its recurrent-state slot,
sliding-window table and the state checkpoints to load and save. Pure: the actor publishes it."""

from __future__ import annotations

from bus.messages import NewSeq, StepPlan
from engine.scheduler.policy import ScheduledStep, Scheduler


def step_plan(step_id: int, step: ScheduledStep, sched: Scheduler) -> StepPlan:
    return StepPlan(
        step_id,
        [NewSeq(s.seq_id, s.prompt_token_ids, s.sampling, s.eos_token_ids) for s in step.new_seqs],
        step.seq_ids, step.num_computed, step.num_new,
        [s.block_table for s in step.seqs], step.finished_ids, step.weight_epoch,
        [s.state_slot for s in step.seqs] if sched.state_slots else [],
        [s.window_table for s in step.seqs] if sched.blocks.windows is not None else [],
        [(s.state_slot, c) for s, c in step.loads], [(s.state_slot, c) for s, c, _ in step.saves])
