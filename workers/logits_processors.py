"""What a sampled row asks of its logits, and the edits that give it (the sampler's processing before the draw,
vLLM v1's order; workers/sampler.py runs them and documents the order and the values reported):

  logit_bias, then the repetition / presence / frequency penalties  apply_penalties (in place)
  the bans: allowed_token_ids, bad words, stop and EOS until min_tokens  ban (in place)
  a structured-output row's grammar mask, then its bans                apply_grammar_and_ban (a new tensor)
  min_p, top_k, top_p on the temperature-scaled logits                 filter_rows

`RowState` is one sequence's sampling state as the worker keeps it across steps; the predicates (is_plain,
is_edited, is_banned, needs_edit, has_filters) tell the sampler which of the above a row needs, so the rows nothing
changes skip them all. Every function here reads each row on its own: a row's result never depends on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bus.sampling_params import SamplingParams
from workers.grammar import SeqGrammar, StepMasks, apply_masks

TOPK_CHUNK = 256  # vocabulary slice of the two-stage top-k
FILTER_CANDIDATES = (256, 4096)  # top_k / top_p look at this many largest logits per row before sorting it whole


@dataclass(slots=True)
class RowState:
    """What sampling needs to know about one sequence (kept by the worker across steps)."""

    params: SamplingParams
    eos_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    grammar: SeqGrammar | None = None  # structured outputs: this sequence's matcher (workers/grammar.py)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact `x.topk(k, dim=-1)` (values descending) for [S, V], several times faster on CPU for small k:
    the k slices of TOPK_CHUNK entries with the largest maxima hold every top-k entry (the k-th largest
    value is at least the k-th largest slice maximum), so only those k x TOPK_CHUNK entries are sorted.
    Among equal values the index chosen may differ from torch.topk's."""
    n, v = x.shape
    if k * TOPK_CHUNK * 4 > v:
        return x.topk(k, dim=-1)
    pad = (-v) % TOPK_CHUNK
    xp = F.pad(x, (0, pad), value=float("-inf")) if pad else x
    blocks = xp.view(n, -1, TOPK_CHUNK)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [n, k] slices
    cand = blocks.gather(1, best.unsqueeze(-1).expand(n, k, TOPK_CHUNK)).reshape(n, k * TOPK_CHUNK)
    vals, pos = cand.topk(k, dim=-1)
    return vals, best.gather(1, pos // TOPK_CHUNK) * TOPK_CHUNK + pos % TOPK_CHUNK


def is_plain(r: RowState) -> bool:
    """Nothing changes this row's distribution: processed == raw, mass 1."""
    p = r.params
    return (p.temperature in (0.0, 1.0) and not is_edited(r) and not is_banned(r)
            and (p.temperature == 0.0 or not has_filters(r)))


def is_edited(r: RowState) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty or p.logit_bias)


def is_banned(r: RowState) -> bool:
    p = r.params
    return (len(r.output_token_ids) < p.min_tokens and bool(p.stop_token_ids or (r.eos_token_ids and not p.ignore_eos))
            or p.allowed_token_ids is not None or bool(p.bad_words_token_ids))


def needs_edit(rows: list[RowState]) -> bool:
    """Whether any row's logits get written in place (penalties, bias, bans): then the batch works on a copy."""
    return any(is_edited(r) or is_banned(r) for r in rows)


def has_filters(r: RowState) -> bool:
    return r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0


def apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> None:
    """logit_bias, then the penalties (vLLM's order), in place."""
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.int64)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.int64)
            counts = torch.zeros(logits.shape[1], dtype=logits.dtype).index_add_(
                0, out, torch.ones(len(out), dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def ban(logits: torch.Tensor, rows: list[RowState]) -> None:
    """-inf, in place, where a row may not draw: outside its allowed_token_ids, the last token of a bad word
    whose other tokens end the output (vLLM: bad words are matched against the output only), and its stop
    and EOS ids until min_tokens."""
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids is not None:
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
            keep = logits[i, ids]
            logits[i].fill_(float("-inf"))
            logits[i, ids] = keep
        if p.bad_words_token_ids:
            out = r.output_token_ids
            last = [w[-1] for w in p.bad_words_token_ids if len(w) - 1 <= len(out) and
                    (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])]
            if last:
                logits[i, last] = float("-inf")
        if len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")


def apply_grammar_and_ban(z: torch.Tensor, masks: StepMasks, rows: list[RowState]) -> torch.Tensor:
    """The grammar mask, then the bans, as a new tensor; where both together leave nothing (the grammar can only
    end while EOS is still banned, or allows none of allowed_token_ids) the grammar wins, so the row always has
    a token to draw."""
    z = apply_masks(z, masks)
    banned = [i for i in masks.rows if is_banned(rows[i])]
    kept = z[banned].clone() if banned else None
    ban(z, rows)
    for k, i in enumerate(banned):
        if bool(torch.isneginf(z[i]).all()):
            z[i] = kept[k]
    return z


def filter_rows(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
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
    out, rest = _filter_candidates(logits, top_k, top_p, FILTER_CANDIDATES[0])
    for c in FILTER_CANDIDATES[1:]:  # rows whose filter reaches past the candidates: more of them
        if rest:
            part, left = _filter_candidates(logits[rest], [top_k[i] for i in rest], [top_p[i] for i in rest], c)
            out[rest] = part
            rest = [rest[j] for j in left]
    if rest:  # and past those: the whole row sorted
        out[rest] = filter_sorted(logits[rest], [top_k[i] for i in rest], [top_p[i] for i in rest])
    return out


def _filter_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                       c: int) -> tuple[torch.Tensor, list[int]]:
    """top_k / top_p among each row's c largest logits, not the whole sorted vocabulary (a
    [64, 49k] sort costs ~0.5 s on CPU). A row is done here when its top-k set lies within its candidates and
    its top-p prefix ends inside them (the candidates' mass, normalised over the whole top-k set, reaches
    top_p); the others are returned for the full sort. Which path a row takes depends on that row alone, so
    the result stays independent of the batch."""
    n, v = logits.shape
    c = min(c, v)
    vals, ids = topk(logits, c)
    k = torch.tensor([kk if kk else v for kk in top_k]).unsqueeze(1)
    vals = vals.masked_fill(torch.arange(c).unsqueeze(0) >= k, float("-inf"))
    done = (k <= c).squeeze(1)  # top-k set within the candidates (top-p aside)
    if any(p < 1.0 for p in top_p):
        whole = [i for i, kk in enumerate(top_k) if not kk and top_p[i] < 1.0]
        lse = torch.logsumexp(vals, dim=-1)  # the top-k set's normaliser where it is all inside
        if whole:  # no top-k: normalised over the whole vocabulary
            lse[whole] = torch.logsumexp(logits[whole], dim=-1)
        probs = torch.exp(vals - lse.unsqueeze(1))
        before = probs.cumsum(dim=-1) - probs
        # a row without top-p (1.0) drops nothing (see _filter_sorted)
        cut = torch.tensor([p if p < 1.0 else float("inf") for p in top_p]).unsqueeze(1)
        vals = vals.masked_fill(before >= cut, float("-inf"))
        # past the candidates, a top-p row drops everything once the candidates' mass reaches top_p
        reached = probs.sum(dim=-1) >= cut.squeeze(1)
        done |= reached & torch.tensor([not kk and p < 1.0 for kk, p in zip(top_k, top_p)])
    out = torch.full_like(logits, float("-inf")).scatter_(1, ids, vals)
    plain = [i for i in range(n) if not top_k[i] and top_p[i] >= 1.0]  # no filter: the row as it came
    if plain:
        out[plain] = logits[plain]
        done[plain] = True
    return out, [i for i in range(n) if not done[i]]


def filter_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top_k / top_p over the whole sorted vocabulary of each row."""
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
        # a row without top-p (1.0) drops nothing, even where the mass before a token rounds to 1.0 in fp32
        # (a strongly biased token), so it samples the same bits in a batch with top-p rows as alone
        cut = torch.tensor([p if p < 1.0 else float("inf") for p in top_p]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(before >= cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
