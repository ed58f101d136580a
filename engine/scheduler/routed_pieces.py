"""Routed experts on their way through the scheduler (`--enable-return-routed-experts`): a step's rows are
filed under their sequences as they come in, and every output carries what was filed since the sequence's
previous one, merged into one piece (engine.routed_experts). Pure: no sockets."""

from __future__ import annotations

from bus.messages import RequestOutput, StepResult
from engine.request import SeqStatus, Sequence
from engine.routed_experts import merge as merge_routed
from engine.scheduler.policy import ScheduledStep


def file_routed(step: ScheduledStep, res: StepResult) -> None:
    """Routed experts of this step, filed as numpy views under their sequences until their next output
    (a partial prefill chunk has none). Sequences aborted while the step ran drop theirs."""
    seqs = {s.seq_id: s for s in step.seqs}
    rows = res.routed_experts
    for sid, start, first, n in res.routed_spans or ():
        seq = seqs.get(sid)
        if seq is not None and seq.status is not SeqStatus.FINISHED:
            seq.routed_pieces.append((start, rows[first:first + n]))


def with_routes(seq: Sequence, out: RequestOutput) -> RequestOutput:
    """Every output carries the routed experts computed since the sequence's previous one."""
    if seq.routed_pieces:
        out.routed_experts_start, out.routed_experts = merge_routed(seq.routed_pieces)
        seq.routed_pieces = []
    return out
