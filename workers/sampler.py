"""Token sampling for one step's batch of rows (one row per sampled sequence).

Order, as vLLM v1: raw logits -> logprobs reported to the user (raw_logprobs: log-softmax of the
model's logits, before penalties and temperature) -> penalties -> min_tokens masking -> temperature
-> min_p / top_k / top_p -> sample. Greedy rows (temperature 0) take the argmax of the penalised
logits. A seeded row draws from its own torch.Generator, so its tokens depend only on its own seed
and history, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RowState:
    """What sampling needs to know about one sequence (kept by the worker across steps)."""

    params: SamplingParams
    eos_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] fp32, of the sampled tokens
    topk_ids: torch.Tensor  # [S, K] int64
    topk_logprobs: torch.Tensor  # [S, K] fp32


def sample(logits: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> SampleOutput:
    """logits [S, V] fp32."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    edited = _needs_edit(rows)
    logits = logits.clone() if edited else logits
    _apply_penalties(logits, rows)
    _mask_until_min_tokens(logits, rows)

    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    greedy = temps == 0
    token_ids = torch.empty(len(rows), dtype=torch.int64)
    if greedy.any():
        token_ids[greedy] = logits[greedy].argmax(dim=-1)
    if not greedy.all():
        idx = (~greedy).nonzero().squeeze(1)
        sub_rows = [rows[i] for i in idx.tolist()]
        if not edited and all(r.params.temperature == 1.0 and not _filters(r) for r in sub_rows):
            probs = raw_logprobs[idx].exp()  # the common RL case: plain sampling at temperature 1
        else:
            sub = logits[idx] / temps[idx].unsqueeze(1)
            probs = torch.softmax(_filter(sub, sub_rows), dim=-1)
        token_ids[idx] = _draw(probs, sub_rows, default_generator)

    k = max((r.params.logprobs or 0) for r in rows)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if k:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
    else:
        top_lp = torch.empty(len(rows), 0)
        top_ids = torch.empty(len(rows), 0, dtype=torch.int64)
    return SampleOutput(token_ids, chosen, top_ids, top_lp)


def _needs_edit(rows: list[RowState]) -> bool:
    return any(
        r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        or len(r.output_token_ids) < r.params.min_tokens
        for r in rows
    )


def _filters(r: RowState) -> bool:
    return r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0


def _apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.int64)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.int64)
            counts = torch.zeros(logits.shape[1], dtype=logits.dtype).index_add_(
                0, out, torch.ones(len(out), dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_until_min_tokens(logits: torch.Tensor, rows: list[RowState]) -> None:
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """min_p, top_k, top_p on temperature-scaled logits [S, V]; filtered entries become -inf."""
    top_k = [r.params.top_k if r.params.top_k > 0 else 0 for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        probs = torch.softmax(logits, dim=-1)
        thresh = torch.tensor(min_p, dtype=logits.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    v = logits.shape[1]
    if any(top_k):
        k = torch.tensor([kk if kk else v for kk in top_k]).clamp(max=v)
        ranks = torch.arange(v).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already reaches top_p (the first token is always kept).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= torch.tensor(top_p).unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _draw(probs: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row, from the row's own generator when it has a seed.

    One draw per row (not one per vocabulary entry, as exponential/Gumbel races need) keeps a seeded
    row's randomness tiny and cheap; the cumulative sum runs in float64 so the 50k-entry CDF stays exact
    enough, and `right=True` never lands on a token of zero probability."""
    u = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=default_generator)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator)
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

