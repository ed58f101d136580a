"""Token sampling for one step's batch of rows (one row per sampled sequence), and the logprobs the
engine reports about it.

Order, as vLLM v1: raw logits -> logit_bias -> penalties -> bans (min_tokens, allowed_token_ids,
bad_words, the grammar) -> temperature -> min_p -> top_k -> top_p -> sample. (vLLM bans before the bias;
a ban is -inf, which neither the bias nor a penalty changes, so the values are the same.) Greedy rows
(temperature 0) take the argmax of the penalised, banned logits. A seeded row draws from its own
torch.Generator, so its tokens depend only on its own seed and history, never on which other requests
share the batch. A trace-replay row takes the next trace token instead
of drawing one.

What is reported (`--logprobs-mode`, vLLM's meaning; docs/logprobs.md is the contract):
  raw_logprobs        log_softmax(logits): the model's distribution, before penalties and temperature
  raw_logits          the logits themselves
  processed_logprobs  log_softmax of the logits the draw used: penalised, banned, divided by the
                      temperature (1 for greedy rows), filtered by min_p/top_k/top_p (-inf outside)
  processed_logits    those processed logits
`rank` counts the vocabulary entries whose value is >= the token's (1 = the most likely). With
`return_sampling_mass`, `mass` = sum over the tokens the sampler could draw of softmax(z / T), where z
are the biased, penalised logits before the bans and the filters, so processed_logprob = log_softmax(z / T) -
log(mass) exactly. Rows whose distribution nothing changes (temperature 1, no bias, penalty, filter or ban)
have processed == raw and mass 1 without computing anything.

Sampling mask (--return-sampling-mask, vLLM's): per sampled row, the token ids the sampler could have drawn,
i.e. the support of the processed distribution (every id whose processed logit is finite: what top-k/top-p/
min-p, the bans and the grammar kept), so the sampled token is always in it and processed_logprobs are
-inf exactly outside it. It travels compact (`mask_counts`): a row keeping at most half the vocabulary
lists its kept ids (count c >= 0, then c ids); a wider one lists the ids it dropped (count -d-1, then d ids),
so a row nothing filtered costs one number.

Structured outputs (workers/grammar.py): a constrained row's grammar mask (-inf outside the tokens the
grammar allows) is applied with the min_tokens ban, so raw values ignore it while processed values and
the kept mass include it; such a row is never "plain". With no mask in the batch nothing of this runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bus.sampling_params import SamplingParams
from workers.grammar import SeqGrammar, StepMasks, apply_masks

TOPK_CHUNK = 256  # vocabulary slice of the two-stage top-k
FILTER_CANDIDATES = (256, 4096)  # top_k / top_p look at this many largest logits per row before sorting it whole
DRAW_ROWS = 8  # rows per slice of the inverse-CDF draw (8 x 152k vocabulary x float64 = 9.7 MB)
# Bytes of one [rows, V] fp32 tensor in a step's sampling span (sample_in_spans). glibc serves a block above
# its mmap threshold (at most 32 MiB) with a fresh mapping each time: a 1,024-row step's logits (200 MB for
# SmolLM2) were faulted in page by page every step, and on huge pages they stalled on compaction.
SPAN_BYTES = 16 << 20
MIN_SPAN_ROWS = 16
# Bytes of one CPU LM head product (head_rows): at most the heap's mmap threshold on a CPU worker
# (ascend_ops.platform.HOST_MMAP_THRESHOLD), so its output is reused heap, never a fresh mapping.
HEAD_BYTES = 32 << 20
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass(slots=True)
class RowState:
    """What sampling needs to know about one sequence (kept by the worker across steps)."""

    params: SamplingParams
    eos_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    grammar: SeqGrammar | None = None  # structured outputs: this sequence's matcher (workers/grammar.py)


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] fp32: the reported value (see --logprobs-mode) of each chosen token
    topk_ids: torch.Tensor  # [S, K] int64
    topk_logprobs: torch.Tensor  # [S, K] fp32, same kind of value
    ranks: torch.Tensor | None = None  # [S] int64, when any row asked for logprobs
    sampling_mass: torch.Tensor | None = None  # [S] fp32, when any row asked for it
    mask_ids: torch.Tensor | None = None  # int32, the rows' ids one after another (with --return-sampling-mask)
    mask_counts: torch.Tensor | None = None  # [S] int32: c >= 0 kept ids, or -d-1: all but d dropped ids


def span_rows(vocab: int) -> int:
    """Rows per sampling span for this vocabulary (SPAN_BYTES of fp32 logits, at least MIN_SPAN_ROWS)."""
    return max(MIN_SPAN_ROWS, SPAN_BYTES // (4 * vocab))


def head_rows(rows: int, vocab: int, itemsize: int) -> int:
    """Rows per LM head product on a CPU for a step sampling `rows` rows: the products split the rows evenly, each
    [rows, V] product (`itemsize` bytes a value) within HEAD_BYTES. Each product streams every weight of the head,
    so fewer, larger products read it fewer times, and even ones keep each product's rows a GEMM's worth: a
    64-row step of Qwen3's 151,936-token head (311 MB in bf16, 622 MB in fp32) took three products of 27, 27
    and 10 rows (one per sampling span), now one in bf16 and two of 32 in fp32."""
    cap = max(1, HEAD_BYTES // (vocab * itemsize))
    return -(-rows // -(-rows // cap)) if rows else 1


def num_top(rows: list[RowState], vocab: int) -> int:
    """Top-logprob columns a step reports: the most any row asked for."""
    return min(max(r.params.num_logprobs(vocab) for r in rows), vocab)


def sample_in_spans(logits_of: Callable[[int, int], torch.Tensor | None], rows: list[RowState],
                    default_generator: torch.Generator, logprobs_mode: str = "raw_logprobs",
                    masks: StepMasks | Callable[[], StepMasks] | None = None, *, vocab: int,
                    span: int | None = None, sampling_mask: bool = False) -> SampleOutput | None:
    """`sample` over the rows in spans of `span` rows (span_rows(vocab) by default): `logits_of(a, b)`
    gives the fp32 host logits of rows a..b-1 (None on a tp rank that does not sample, for every span), so no
    [S, V] tensor of the step is ever whole and each span's temporaries reuse the heap. Every row gets what
    `sample` over the whole batch gives it: its values depend on its own logits only, unseeded rows draw the
    shared generator's uniforms in row order either way, and all spans report `num_top` columns. `masks` may
    be a function that returns them (grammar masks still filling): called after the first span's logits."""
    n = len(rows)
    span = span or span_rows(vocab)
    top = num_top(rows, vocab)
    parts: list[SampleOutput] = []
    for a in range(0, n, span):
        b = min(a + span, n)
        logits = logits_of(a, b)  # every span, on every tp rank: the LM head's gather is a collective
        if logits is None:
            continue
        if callable(masks):
            masks = masks()
        whole = b - a == n  # one span: the rows and masks as they are, no slice or window copy
        parts.append(sample(logits, rows if whole else rows[a:b], default_generator, logprobs_mode,
                            masks if whole or masks is None else masks.window(a, b), top=top,
                            sampling_mask=sampling_mask))
    if len(parts) <= 1:
        return parts[0] if parts else None
    return _concat(parts)


def _concat(parts: list[SampleOutput]) -> SampleOutput:
    def cat(name: str, fill: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
        got = [getattr(p, name) for p in parts]
        if all(t is None for t in got):
            return None
        # a span where no row asked for ranks / mass: values no row reads (ranks) or the plain rows' 1.0
        return torch.cat([t if t is not None else fill(len(p.token_ids)) for p, t in zip(parts, got)])

    return SampleOutput(torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]),
                        torch.cat([p.topk_ids for p in parts]), torch.cat([p.topk_logprobs for p in parts]),
                        cat("ranks", lambda k: torch.zeros(k, dtype=torch.int64)),
                        cat("sampling_mass", lambda k: torch.ones(k, dtype=torch.float32)),
                        cat("mask_ids", lambda k: torch.zeros(0, dtype=torch.int32)),
                        cat("mask_counts", lambda k: torch.zeros(k, dtype=torch.int32)))


def sample(logits: torch.Tensor, rows: list[RowState], default_generator: torch.Generator,
           logprobs_mode: str = "raw_logprobs", masks: StepMasks | None = None, *,
           top: int | None = None, sampling_mask: bool = False) -> SampleOutput:
    """logits [S, V] fp32 (not modified); masks: the grammar bitmask of the constrained rows, if any;
    top: the top-logprob columns to report (default: the most these rows asked for); sampling_mask: report
    each row's support (mask_ids, mask_counts)."""
    n, vocab = logits.shape
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    # a private copy only for in-place edits: the grammar mask writes a new tensor (apply_masks)
    z = logits.clone() if _needs_edit(rows) else logits
    _apply_penalties(z, rows)
    processed_mode = logprobs_mode.startswith("processed")
    want_lp = [r.params.logprobs is not None for r in rows]
    want_mass = [r.params.return_sampling_mass for r in rows]
    temps = [r.params.temperature for r in rows]
    greedy = [t == 0.0 for t in temps]
    trace = [_trace_token(r) for r in rows]
    plain = [_plain(r) for r in rows]
    if masks is not None:
        for i in masks.rows:
            plain[i] = False
    # Rows whose processed distribution must be built: drawn ones that something changes, and any row
    # whose processed values or kept mass were asked for.
    proc = [i for i in range(n) if not plain[i] and (
        (not greedy[i] and trace[i] is None) or want_mass[i] or (want_lp[i] and processed_mode))]
    lse_full = None
    if proc and any(want_mass[i] for i in proc):
        t = torch.tensor([temps[i] or 1.0 for i in proc], dtype=z.dtype).unsqueeze(1)
        lse_full = torch.logsumexp(z[proc] / t, dim=-1)  # before the ban and the filters
    if masks is None:
        _ban(z, rows)
    else:
        z = _apply_grammar_and_ban(z, masks, rows)

    processed = None  # [len(proc), V] processed logits
    if proc:
        if z is not logits and len(proc) == n and all(temps[i] in (0.0, 1.0) for i in proc):
            scaled = z  # a private copy already (masked or edited): no [S, V] copy and divide by 1
        else:
            t = torch.tensor([temps[i] or 1.0 for i in proc], dtype=z.dtype).unsqueeze(1)
            scaled = z[proc] / t
        drawn = [i for i, row in enumerate(proc) if not greedy[row]]
        # greedy rows are not filtered (vLLM resets their top_k/top_p/min_p); rows without a filter (a masked
        # batch at temperature 1) skip the gather and scatter of their [rows, V] logits
        if drawn and any(_filters(rows[proc[i]]) for i in drawn):
            scaled[drawn] = _filter(scaled[drawn], [rows[proc[i]] for i in drawn])
        processed = scaled

    token_ids = torch.empty(n, dtype=torch.int64)
    g = [i for i in range(n) if greedy[i] and trace[i] is None]
    if g:
        token_ids[g] = z[g].argmax(dim=-1)
    draw = [i for i in range(n) if not greedy[i] and trace[i] is None]
    if draw:
        pos = {row: k for k, row in enumerate(proc)}
        if all(plain[i] for i in draw):  # the common RL case: plain sampling at temperature 1
            token_ids[draw] = draw_logprobs(raw_logprobs if len(draw) == n else raw_logprobs[draw],
                                            [rows[i] for i in draw], default_generator)
        else:
            ks = [k for k, i in enumerate(draw) if not plain[i]]  # one batched softmax (many masked rows)
            sel = [pos[draw[k]] for k in ks]
            src = processed if sel == list(range(len(processed))) else processed[sel]  # no gather when all
            if len(ks) == len(draw):  # a masked batch: every drawn row is processed
                probs = torch.softmax(src, dim=-1)
            else:
                probs = torch.empty(len(draw), vocab, dtype=logits.dtype)
                probs[ks] = torch.softmax(src, dim=-1)
                ks = [k for k, i in enumerate(draw) if plain[i]]
                probs[ks] = raw_logprobs[[draw[k] for k in ks]].exp()
            token_ids[draw] = _draw(probs, [rows[i] for i in draw], default_generator)
    for i, tok in enumerate(trace):
        if tok is not None:
            token_ids[i] = tok

    # The values reported, per --logprobs-mode; processed rows overwrite the raw ones.
    base = logits if logprobs_mode.endswith("logits") else raw_logprobs
    vals = base
    if processed_mode and any(want_lp) and processed is not None:
        keep = [k for k, row in enumerate(proc) if want_lp[row]]
        if keep:
            vals = base.clone()
            p = processed[keep]
            vals[[proc[k] for k in keep]] = p if logprobs_mode == "processed_logits" else torch.log_softmax(p, -1)
    k = num_top(rows, vocab) if top is None else top
    chosen = vals.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = None
    # Ranks come from the top-k when the token is in it (the usual case), so only the other rows pay
    # for a count over the vocabulary; hence at least 2 columns when ranks are wanted.
    k_eff = min(max(k, 2), vocab) if any(want_lp) else k
    if k_eff:
        top_lp, top_ids = topk(vals, k_eff)
    else:
        top_lp = torch.empty(n, 0)
        top_ids = torch.empty(n, 0, dtype=torch.int64)
    if any(want_lp):
        ranks = (top_lp >= chosen.unsqueeze(1)).sum(dim=-1)
        # exact only where every entry >= the token is among the top columns
        outside = (chosen <= top_lp[:, -1]).nonzero().squeeze(1) if k_eff < vocab else torch.empty(0, dtype=torch.long)
        if len(outside):
            ranks[outside] = (vals[outside] >= chosen[outside].unsqueeze(1)).sum(dim=-1)
    top_lp, top_ids = top_lp[:, :k], top_ids[:, :k]
    mass = None
    if any(want_mass):
        mass = torch.ones(n, dtype=torch.float32)
        if lse_full is not None:
            idx = [k2 for k2, row in enumerate(proc) if want_mass[row]]
            kept = torch.logsumexp(processed[idx], dim=-1) - lse_full[idx]
            mass[[proc[k2] for k2 in idx]] = kept.exp().float()
    out = SampleOutput(token_ids, chosen.float(), top_ids, top_lp.float(), ranks, mass)
    if sampling_mask:
        out.mask_ids, out.mask_counts = _support(z, processed, proc, plain)
    return out


def _support(z: torch.Tensor, processed: torch.Tensor | None, proc: list[int],
             plain: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's support, compact (see the module doc): the entries above -inf of its processed logits, which
    are `processed` for the rows in `proc`, `z` (the banned logits, no filter) for other rows something
    changed, and the whole vocabulary (one count, no scan) for plain rows. A compare, a row sum and a
    nonzero over the scanned rows only (torch.isfinite, nonzero(as_tuple=True) and a nonzero over a wide row
    are each ~10x slower on CPU; measured on 64 x 49,152)."""
    n, vocab = z.shape
    ninf = float("-inf")
    counts = torch.full((n,), -1, dtype=torch.int32)
    other = [i for i in range(n) if not plain[i] and i not in set(proc)]
    scanned = proc + other
    if not scanned:
        return torch.zeros(0, dtype=torch.int32), counts
    if not other:
        finite = processed > ninf
    else:
        finite = torch.cat([processed, z[other]]) > ninf if proc else z[other] > ninf
    kept = finite.view(torch.uint8).sum(dim=1, dtype=torch.int32)  # (a bool sum is 4x slower)
    wide = kept > vocab // 2
    if bool(wide.any()):  # list what such rows dropped instead
        finite = torch.where(wide.unsqueeze(1), ~finite, finite)
    at = finite.nonzero()  # [ids, 2]: (scanned row, id), row-major
    counts[scanned] = torch.where(wide, kept - vocab - 1, kept).to(torch.int32)  # -(dropped) - 1 if wide
    ids = at[:, 1].to(torch.int32)
    if scanned != sorted(scanned) or len(scanned) < n:  # back into batch order, plain rows listing nothing
        sizes = torch.bincount(at[:, 0], minlength=len(scanned)).tolist()
        parts = dict(zip(scanned, ids.split(sizes)))
        ids = torch.cat([parts[i] for i in range(n) if i in parts])
    return ids, counts


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


def _trace_token(r: RowState) -> int | None:
    trace = r.params.trace_decode_token_ids
    if trace and len(r.output_token_ids) < len(trace):
        return int(trace[len(r.output_token_ids)])
    return None


def _plain(r: RowState) -> bool:
    """Nothing changes this row's distribution: processed == raw, mass 1."""
    p = r.params
    return (p.temperature in (0.0, 1.0) and not _row_edited(r) and not _banned(r)
            and (p.temperature == 0.0 or not _filters(r)))


def _row_edited(r: RowState) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty or p.logit_bias)


def _banned(r: RowState) -> bool:
    p = r.params
    return (len(r.output_token_ids) < p.min_tokens and bool(p.stop_token_ids or (r.eos_token_ids and not p.ignore_eos))
            or p.allowed_token_ids is not None or bool(p.bad_words_token_ids))


def _needs_edit(rows: list[RowState]) -> bool:
    """Whether any row's logits get written in place (penalties, bias, bans): then the batch works on a copy."""
    return any(_row_edited(r) or _banned(r) for r in rows)


def _filters(r: RowState) -> bool:
    return r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0


def _apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> None:
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


def _ban(logits: torch.Tensor, rows: list[RowState]) -> None:
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


def _apply_grammar_and_ban(z: torch.Tensor, masks: StepMasks, rows: list[RowState]) -> torch.Tensor:
    """The grammar mask, then the bans, as a new tensor; where both together leave nothing (the grammar can only
    end while EOS is still banned, or allows none of allowed_token_ids) the grammar wins, so the row always has
    a token to draw."""
    z = apply_masks(z, masks)
    banned = [i for i in masks.rows if _banned(rows[i])]
    kept = z[banned].clone() if banned else None
    _ban(z, rows)
    for k, i in enumerate(banned):
        if bool(torch.isneginf(z[i]).all()):
            z[i] = kept[k]
    return z


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
    out, rest = _filter_candidates(logits, top_k, top_p, FILTER_CANDIDATES[0])
    for c in FILTER_CANDIDATES[1:]:  # rows whose filter reaches past the candidates: more of them
        if rest:
            part, left = _filter_candidates(logits[rest], [top_k[i] for i in rest], [top_p[i] for i in rest], c)
            out[rest] = part
            rest = [rest[j] for j in left]
    if rest:  # and past those: the whole row sorted
        out[rest] = _filter_sorted(logits[rest], [top_k[i] for i in rest], [top_p[i] for i in rest])
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


def _filter_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
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


def draw_logprobs(lp: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """`_draw(lp.exp(), ...)` for rows of log-probabilities: on CPU one fused kernel (ascend_ops/csrc/
    cpu_sampling.cpp: no [S, V] exp and float64 cumsum; the same uniforms and the same rule, the sums in
    another order), elsewhere, or without the CPU kernels, the torch path."""
    kernel = _draw_kernel() if lp.device.type == "cpu" and lp.dtype == torch.float32 and lp.stride(-1) == 1 else None
    if kernel is None:
        return _draw(lp.exp(), rows, default_generator)
    return kernel(lp, _uniforms(rows, default_generator))


@functools.cache
def _draw_kernel():
    from ascend_ops.cpu_kernels import ops

    kernels = ops()
    return None if kernels is None else kernels.draw_logprobs


def _uniforms(rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """One float64 uniform per row, from the row's own generator when it has a seed."""
    unseeded = sum(r.generator is None for r in rows)
    if unseeded == len(rows):
        return torch.rand(len(rows), dtype=torch.float64, generator=default_generator)
    # the seeded rows' draws gathered in Python, then one tensor: an indexed write per row cost ~1 ms / 64
    shared = iter(torch.rand(unseeded, dtype=torch.float64, generator=default_generator).tolist() if unseeded else [])
    return torch.tensor([next(shared) if r.generator is None else
                         torch.rand(1, dtype=torch.float64, generator=r.generator).item() for r in rows],
                        dtype=torch.float64)


def _draw(probs: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row, from the row's own generator when it has a seed.

    One draw per row (not one per vocabulary entry, as exponential/Gumbel races need) keeps a seeded
    row's randomness tiny and cheap; the cumulative sum runs in float64 so the 50k-entry CDF stays exact
    enough, and `right=True` never lands on a token of zero probability."""
    u = _uniforms(rows, default_generator)
    # Rows in slices of DRAW_ROWS through one float64 buffer: a whole [S, V] float64 copy and its cumsum
    # cost more in page faults than in arithmetic (each row's sum runs in the same order either way).
    n, vocab = probs.shape
    out = torch.empty(n, dtype=torch.int64)
    buf = torch.empty(min(n, DRAW_ROWS), vocab, dtype=torch.float64)
    for a in range(0, n, DRAW_ROWS):
        b = min(a + DRAW_ROWS, n)
        cdf = torch.cumsum(probs[a:b], dim=-1, dtype=torch.float64, out=buf[: b - a])
        target = (u[a:b] * cdf[:, -1]).unsqueeze(1)
        out[a:b] = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return out.clamp_(max=vocab - 1)
