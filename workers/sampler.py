"""Token sampling for one step's batch of rows (one row per sampled sequence), and the logprobs the
engine reports about it.

Order, as vLLM v1: raw logits -> logit_bias -> penalties -> bans (min_tokens, allowed_token_ids,
bad_words, the grammar) -> temperature -> min_p -> top_k -> top_p -> sample. (vLLM bans before the bias;
a ban is -inf, which neither the bias nor a penalty changes, so the values are the same.) Greedy rows
(temperature 0) take the argmax of the penalised, banned logits. A seeded row draws from its own
torch.Generator, so its tokens depend only on its own seed and history, never on which other requests
share the batch. A trace-replay row takes the next trace token instead
of drawing one. The edits each row asks for are workers/logits_processors.py's, the draw workers/draw.py's;
this module runs them in that order and owns what is reported.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.draw import draw_logprobs, draw_probs
from workers.grammar import StepMasks
from workers.logits_processors import (
    RowState,
    apply_grammar_and_ban,
    apply_penalties,
    ban,
    filter_rows,
    has_filters,
    is_plain,
    needs_edit,
    topk,
)

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
    z = logits.clone() if needs_edit(rows) else logits
    apply_penalties(z, rows)
    processed_mode = logprobs_mode.startswith("processed")
    want_lp = [r.params.logprobs is not None for r in rows]
    want_mass = [r.params.return_sampling_mass for r in rows]
    temps = [r.params.temperature for r in rows]
    greedy = [t == 0.0 for t in temps]
    trace = [_trace_token(r) for r in rows]
    plain = [is_plain(r) for r in rows]
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
        ban(z, rows)
    else:
        z = apply_grammar_and_ban(z, masks, rows)

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
        if drawn and any(has_filters(rows[proc[i]]) for i in drawn):
            scaled[drawn] = filter_rows(scaled[drawn], [rows[proc[i]] for i in drawn])
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
            token_ids[draw] = draw_probs(probs, [rows[i] for i in draw], default_generator)
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


def _trace_token(r: RowState) -> int | None:
    trace = r.params.trace_decode_token_ids
    if trace and len(r.output_token_ids) < len(trace):
        return int(trace[len(r.output_token_ids)])
    return None


