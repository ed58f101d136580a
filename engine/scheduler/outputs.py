"""What the scheduler tells the gateways about each request: one RequestOutput per sampled token (with the
logprobs, ranks, sampling mass and mask rows its request asked for), the final output of a request that
ends without a token (aborted, refused, failed). Pure: the actor (engine.scheduler.actor) queues what
these build and sends it."""

from __future__ import annotations

from bus.messages import ErrorInfo, PromptLogprobs, RequestOutput, StepResult
from engine import sampling_mask
from engine.request import Sequence
from engine.scheduler.policy import ScheduledStep, SeqUpdate
from engine.scheduler.routed_pieces import with_routes


def update_output(u: SeqUpdate, res: StepResult, i: int, prompt_lp: PromptLogprobs | None,
                  mask_at: list[int] | None = None) -> RequestOutput:
    """One sampled token of one sequence, with what the request asked to know about it."""
    seq = u.seq
    sp = seq.sampling
    epoch = res.weight_epoch
    kv_epoch = u.kv_epoch
    finished = u.finished
    logprobs = top = ranks = mass = None
    if sp.logprobs is not None:
        logprobs = [u.logprob]
        if sp.logprobs:
            k = None if sp.logprobs == -1 else sp.logprobs  # -1: every column the worker computed (the vocab)
            top = [[[int(t), float(lp)] for t, lp in zip(res.topk_ids[i, :k], res.topk_logprobs[i, :k])]]
        if res.ranks is not None:
            ranks = [int(res.ranks[i])]
    if sp.return_sampling_mass and res.sampling_mass is not None:
        mass = [float(res.sampling_mass[i])]
    out = RequestOutput(seq.seq_id, [u.token_id], logprobs, top, finished,
                        seq.finish_reason if finished else None, seq.stop_reason if finished else None,
                        None, len(seq.prompt_token_ids), seq.num_cached_tokens, epoch,
                        kv_epoch is not None and kv_epoch != epoch, ranks, mass, prompt_lp)
    if mask_at is not None:  # --return-sampling-mask: this token's row of the step's mask
        out.sampling_mask_ids = res.sampling_mask_ids[mask_at[i]:mask_at[i + 1]]
        out.sampling_mask_counts = res.sampling_mask_counts[i:i + 1]
    return with_routes(seq, out)


def step_outputs(updates: list[SeqUpdate], res: StepResult) -> list[tuple[Sequence, RequestOutput]]:
    """The outputs of one step's updates, each with its row of the step's result."""
    ids = res.seq_ids
    row = dict(zip(ids, range(len(ids))))
    prompt_lps = {p.seq_id: p for p in res.prompt_logprobs}
    out = update_output
    mask_at = None if res.sampling_mask_counts is None else sampling_mask.starts(res.sampling_mask_counts)
    return [(u.seq, out(u, res, row[u.seq.seq_id], prompt_lps.get(u.seq.seq_id), mask_at)) for u in updates]


def prompt_tokens(step: ScheduledStep) -> int:
    """The prompt tokens a step computed (its prefill chunks; decodes come first and add nothing)."""
    n_prompt = 0
    for q, n, b in zip(step.seqs, step.num_new, step.num_computed):
        p = len(q.prompt_token_ids)
        if b < p:  # a prefill chunk
            n_prompt += min(b + n, p) - b
    return n_prompt


def request_output(seq: Sequence, tokens: list[int], *, finished: bool, error: ErrorInfo | None = None,
                   logprobs: list[float] | None = None, top: list | None = None,
                   weight_epoch: int = 0) -> RequestOutput:
    out = RequestOutput(seq.seq_id, tokens, logprobs, top, finished,
                        seq.finish_reason if finished else None, seq.stop_reason if finished else None,
                        error, seq.num_prompt_tokens, seq.num_cached_tokens, weight_epoch)
    return with_routes(seq, out)

