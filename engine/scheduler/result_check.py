"""Whether a StepResult can be applied to the step it names. Pure: no sockets, no state.

A result decodes only if every field has its type (bus.codec), but a well-typed result can still be wrong
for the step in flight: a rank that does not exist, sequences the step did not run, arrays whose lengths
or shapes do not match its sequences. The scheduler would index past them (or file garbage under a
request), so it drops such a result and logs why; the step completes with the real workers' results.
Only rank 0's samples are applied, so only rank 0's arrays are checked.
"""

from __future__ import annotations

import numpy as np

from bus.messages import StepResult
from engine import sampling_mask
from engine.scheduler.policy import ScheduledStep


def result_problem(res: StepResult, step: ScheduledStep, num_workers: int) -> str | None:
    """Why `res` cannot be applied to `step` (the step it names), or None when it can."""
    if not 0 <= res.rank < num_workers:
        return f"rank {res.rank} does not exist ({num_workers} workers)"
    if res.rank != 0 or res.error is not None or res.interrupted:
        return None  # nothing of it is applied but its failure or interruption
    ids = res.seq_ids
    every = ids == step.seq_ids  # each sequence sampled once, in plan order: the common case, nothing to search
    # the ids as a set, for what names sequences on its own (built only when something does)
    ran = set(step.seq_ids) if not every or res.prompt_logprobs or res.routed_spans else set()
    if not every:
        if len(set(ids)) != len(ids):
            return "a sequence is sampled twice"
        unknown = [s for s in ids if s not in ran]
        if unknown:
            return f"sequences the step did not run: {unknown[:3]}"
    n = len(ids)
    why = (_vector(res.token_ids, n, "token_ids", "iu") or _vector(res.logprobs, n, "logprobs", "f")
           or _table(res.topk_ids, res.topk_logprobs, n, "topk")
           or (res.ranks is not None and _vector(res.ranks, n, "ranks", "iu"))
           or (res.sampling_mass is not None and _vector(res.sampling_mass, n, "sampling_mass", "f"))
           or _mask(res, n))
    if why:
        return why
    toks = res.token_ids
    if toks.size and toks[toks.argmin()] < 0:  # argmin, not min: no ufunc reduction (5x cheaper here)
        return "a negative token id"
    for p in res.prompt_logprobs:
        if p.seq_id not in ran:
            return f"prompt logprobs of a sequence the step did not run: {p.seq_id!r}"
        rows = p.logprobs.shape[0] if p.logprobs.ndim == 1 else -1
        why = (_vector(p.logprobs, rows, "prompt logprobs", "f") or _vector(p.ranks, rows, "prompt ranks", "iu")
               or _table(p.topk_ids, p.topk_logprobs, rows, "prompt topk"))
        if why:
            return why
    return _routes(res, ran)


def _mask(res: StepResult, n: int) -> str | None:
    if res.sampling_mask_counts is None and res.sampling_mask_ids is None:
        return None
    ids, counts = res.sampling_mask_ids, res.sampling_mask_counts
    why = _vector(counts, n, "sampling_mask_counts", "i") or (
        not isinstance(ids, np.ndarray) and "sampling_mask_ids is missing")
    if why:
        return why
    if ids.dtype.kind != "i":
        return "sampling_mask_ids are not integers"
    return sampling_mask.consistent(ids, counts, 1 << 31)  # the vocabulary is the workers'; ids stay in int32


def _vector(a: object, n: int, what: str, kinds: str) -> str | None:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.shape[0] != n or a.dtype.kind not in kinds:
        return f"{what} is not a {n}-vector of {'integers' if 'i' in kinds else 'floats'} ({_shape(a)})"
    return None


def _table(ids: object, lps: object, n: int, what: str) -> str | None:
    if not (isinstance(ids, np.ndarray) and isinstance(lps, np.ndarray) and ids.ndim == 2 and ids.shape[0] == n
            and lps.shape == ids.shape and ids.dtype.kind in "iu" and lps.dtype.kind == "f"):
        return f"{what} ids and logprobs are not two [{n}, K] tables ({_shape(ids)}, {_shape(lps)})"
    return None


def _routes(res: StepResult, ran: set[str]) -> str | None:
    rows = res.routed_experts
    if rows is None:
        return None if not res.routed_spans else "routed spans without routed experts"
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        return f"routed experts are not a [rows, layers, top_k] table of ids ({_shape(rows)})"
    for sid, start, first, n in res.routed_spans or ():
        if sid not in ran:
            return f"routed experts of a sequence the step did not run: {sid!r}"
        if start < 0 or first < 0 or n < 0 or first + n > rows.shape[0]:
            return f"a routed span outside the rows: {[sid, start, first, n]}"
    return None


def _shape(a: object) -> str:
    return f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
