import pytest
import torch

from bus.sampling_params import SamplingParams
from workers.grammar import StepMasks
from workers.sampler import RowState, sample, sample_in_spans, span_rows

pytestmark = pytest.mark.unit


def row(seed=None, out=(), prompt=(1,), **sp):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowState(SamplingParams(**sp), [0], list(prompt), list(out), gen)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    rows = [row() for _ in range(4000)]
    out = sample(logits, rows, torch.Generator().manual_seed(0))
    freq = torch.bincount(out.token_ids, minlength=4).float() / 4000
    assert freq[3] == 0  # zero probability is never drawn
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 50)
    alone = sample(logits[2:3], [row(seed=7)], torch.Generator().manual_seed(1)).token_ids
    mixed_rows = [row(seed=s) if s is not None else row() for s in (None, 3, 7, None, 9, 11)]
    together = sample(logits, mixed_rows, torch.Generator().manual_seed(99)).token_ids
    assert together[2] == alone[0]


def test_greedy_and_raw_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = sample(logits, [row(temperature=0.0, logprobs=2)], torch.Generator())
    assert out.token_ids.tolist() == [1]
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, lp[0, 1:2])
    assert out.topk_ids.tolist() == [[1, 2]]


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).repeat(3000, 1)
    g = torch.Generator().manual_seed(0)
    for sp, allowed in ((dict(top_k=2), {0, 1}), (dict(top_p=0.65), {0, 1}), (dict(top_p=0.3), {0}),
                        (dict(min_p=0.6), {0, 1})):
        toks = set(sample(logits, [row(**sp) for _ in range(3000)], g).token_ids.tolist())
        assert toks == allowed, sp


def test_penalties_and_min_tokens():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    # eos (id 0) is masked until min_tokens outputs exist
    assert sample(logits, [row(temperature=0.0, min_tokens=2, out=[1])], torch.Generator()).token_ids.item() == 1
    # a strong presence penalty on the already generated token 1 moves greedy to token 2... or 0
    r = row(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, out=[0, 0])
    assert sample(logits, [r], torch.Generator()).token_ids.item() == 1
    rep = row(temperature=0.0, repetition_penalty=2.0, prompt=[0])
    assert sample(torch.tensor([[5.0, 4.0, 0.0]]), [rep], torch.Generator()).token_ids.item() == 1


# --- the logprob contract (docs/logprobs.md) ---------------------------------------------------------


def _processed(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Reference processed logits, written independently of workers.sampler (vLLM's order)."""
    z = logits / (temperature or 1.0)
    if min_p:
        p = torch.softmax(z, -1)
        z = z.masked_fill(p < min_p * p.max(), float("-inf"))
    if top_k:
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = z.sort(descending=True)
        p = torch.softmax(srt, -1)
        drop = (p.cumsum(-1) - p) >= top_p
        z = z.clone()
        z[order[drop]] = float("-inf")
    return z


def test_raw_modes_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    r = [row(temperature=0.0, logprobs=2)]
    out = sample(logits, r, torch.Generator(), "raw_logits")
    assert out.token_ids.tolist() == [1] and out.logprobs.tolist() == [3.0] and out.ranks.tolist() == [1]
    assert out.topk_ids.tolist() == [[1, 2]] and out.topk_logprobs.tolist() == [[3.0, 2.0]]
    forced = sample(logits, [row(temperature=0.0, logprobs=-1, trace_decode_token_ids=[3])], torch.Generator())
    assert forced.token_ids.tolist() == [3] and forced.ranks.tolist() == [4]  # the trace wins over the argmax
    assert torch.allclose(forced.logprobs, torch.log_softmax(logits, -1)[0, 3:4])
    assert forced.topk_ids.shape == (1, 4)  # -1: the whole vocabulary


@pytest.mark.parametrize("sp", [dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8),
                                dict(temperature=0.9, min_p=0.05, top_k=20, top_p=0.95), dict(temperature=0.5)])
def test_processed_logprobs_and_kept_mass(sp):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    rows = [row(seed=i, logprobs=5, return_sampling_mass=True, **sp) for i in range(8)]
    proc = sample(logits, rows, torch.Generator(), "processed_logprobs")
    rows = [row(seed=i, logprobs=5, return_sampling_mass=True, **sp) for i in range(8)]
    raw = sample(logits, rows, torch.Generator(), "raw_logprobs")
    assert torch.equal(proc.token_ids, raw.token_ids)  # the mode changes what is reported, never the draw
    for i, tok in enumerate(proc.token_ids.tolist()):
        ref = torch.log_softmax(_processed(logits[i], **sp), -1)
        assert abs(proc.logprobs[i].item() - ref[tok].item()) < 1e-5
        assert torch.allclose(proc.topk_logprobs[i], ref.topk(5).values, atol=1e-5)
        # the contract: processed = log_softmax(logits / T) - log(mass), from the raw side
        scaled = torch.log_softmax(logits[i] / sp["temperature"], -1)[tok]
        assert abs(scaled.item() - torch.log(raw.sampling_mass[i]).item() - ref[tok].item()) < 1e-5
        assert torch.equal(proc.sampling_mass, raw.sampling_mass)
    assert torch.allclose(raw.logprobs, torch.log_softmax(logits, -1).gather(1, raw.token_ids[:, None])[:, 0])


def test_mass_with_min_tokens_ban_and_plain_rows():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    banned = row(seed=1, temperature=1.0, min_tokens=3, return_sampling_mass=True, logprobs=0)  # eos id 0
    out = sample(logits, [banned], torch.Generator(), "processed_logprobs")
    p = torch.softmax(logits[0], -1)
    assert abs(out.sampling_mass.item() - (1 - p[0].item())) < 1e-6 and out.token_ids.item() != 0
    tok = out.token_ids.item()
    assert abs(out.logprobs.item() - (torch.log(p[tok]) - torch.log(1 - p[0])).item()) < 1e-6
    plain = sample(logits, [row(seed=1, return_sampling_mass=True, logprobs=0)], torch.Generator(),
                   "processed_logprobs")
    assert plain.sampling_mass.tolist() == [1.0]
    assert abs(plain.logprobs.item() - torch.log_softmax(logits, -1)[0, plain.token_ids.item()].item()) < 1e-6


def test_greedy_processed_is_penalised_at_temperature_one():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    r = row(temperature=0.0, repetition_penalty=2.0, prompt=[0], logprobs=1, top_k=1)
    out = sample(logits, [r], torch.Generator(), "processed_logprobs")
    z = torch.tensor([1.5, 2.5, 0.0])  # token 0 seen: 3.0 / 2; no top_k for greedy rows (vLLM)
    assert out.token_ids.item() == 1
    assert abs(out.logprobs.item() - torch.log_softmax(z, -1)[1].item()) < 1e-6


def test_plain_seeded_row_ignores_filtered_batch_mates():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    alone = sample(logits[1:2], [row(seed=5)], torch.Generator()).token_ids
    mixed = [row(seed=9, top_k=3, temperature=0.5), row(seed=5), row(temperature=0.0, presence_penalty=1.0, out=[2])]
    assert sample(logits, mixed, torch.Generator()).token_ids[1] == alone[0]


def test_ranks_count_every_entry_at_least_as_likely():
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(2))
    logits[0, :3] = 5.0  # a tie at the top
    for k in (0, 1, 3):
        rows = [row(seed=i, logprobs=k) for i in range(40)]
        rows[0] = row(temperature=0.0, logprobs=k)
        rows[1] = row(logprobs=k, trace_decode_token_ids=[299])  # far outside the top
        out = sample(logits, rows, torch.Generator())
        lp = torch.log_softmax(logits, -1)
        want = (lp >= lp.gather(1, out.token_ids[:, None])).sum(-1)
        assert torch.equal(out.ranks, want), k
        assert out.topk_ids.shape == (40, k)


@pytest.mark.parametrize("shape,k", [((7, 49152), 5), ((3, 5000), 2), ((4, 3001), 3), ((2, 300), 5), ((5, 20000), 20)])
def test_two_stage_topk_is_exact(shape, k):
    from workers.logits_processors import topk

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(k)) * 3
    x[0, 100:110] = float("-inf")
    want_v, want_i = x.topk(k, dim=-1)
    got_v, got_i = topk(x, k)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)
    peaked = torch.full((2, 40000), float("-inf"))
    peaked[:, [5, 39999]] = torch.tensor([1.0, 2.0])
    v, i = topk(peaked, 3)
    assert i[:, :2].tolist() == [[39999, 5]] * 2 and v[:, 2].tolist() == [float("-inf")] * 2


@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0])
def test_top_k_top_p_on_candidates_keep_what_the_whole_sorted_row_keeps(scale):
    """The filter looks at each row's largest logits first (workers.logits_processors.FILTER_CANDIDATES) and sorts a
    whole row only when its nucleus reaches past them: it keeps the same tokens with the same values as the
    whole-row sort, except where a token's mass-before sits within float rounding of top_p, and a row keeps
    the same bits alone and beside rows that take the other paths."""
    from workers.logits_processors import filter_rows, filter_sorted

    gen = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(9, 20000, generator=gen) * scale
    x[1, :19000] = float("-inf")  # fewer finite entries than the second candidate tier
    spec = [(0, 0.9), (50, 1.0), (300, 0.95), (5000, 1.0), (5000, 0.5), (0, 0.999), (0, 1.0), (256, 0.9), (1, 0.3)]
    rows = [row(top_k=k, top_p=p) for k, p in spec]
    got = filter_rows(x, rows)
    want = filter_sorted(x, [k for k, _ in spec], [p for _, p in spec])
    for i, (k, p) in enumerate(spec):
        kept_got, kept_want = torch.isfinite(got[i]), torch.isfinite(want[i])
        differ = (kept_got != kept_want).nonzero().flatten()
        if len(differ):  # only at the top-p boundary: the mass before those tokens rounds to top_p
            probs = torch.softmax(want[i].masked_fill(~kept_want, float("-inf")) if k else x[i], -1).double()
            order = x[i].argsort(descending=True)
            before = probs[order].cumsum(0) - probs[order]
            rank = {t: r for r, t in enumerate(order.tolist())}
            assert all(abs(before[rank[t]].item() - p) < 1e-5 for t in differ.tolist()), (k, p)
        both = kept_got & kept_want
        assert torch.equal(got[i][both], x[i][both]), (k, p)
        alone = filter_rows(x[i:i + 1], [rows[i]])
        assert torch.equal(alone[0], got[i]), (k, p)


# --- the fused CPU draw (ascend_ops/csrc/cpu_sampling.cpp) -----------------------------------------------------

def _draw_kernel_or_skip():
    from workers.draw import _draw_kernel

    kernel = _draw_kernel()
    if kernel is None:
        pytest.skip("the CPU kernels are not built here (python -m ascend_ops.cpu_kernels)")
    return kernel


def _brackets(lp: torch.Tensor, u: torch.Tensor, tokens: torch.Tensor) -> None:
    """Each token is one the exact (float64) inverse CDF allows at its uniform, up to float32 exp rounding:
    cdf[t - 1] <= u * total <= cdf[t], within 1e-6 of the total, and never a token of zero probability."""
    p = lp.double().exp()
    cdf = p.cumsum(-1)
    total = cdf[:, -1]
    target = u * total
    before = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(total))
    at = cdf.gather(1, tokens.unsqueeze(1)).squeeze(1)
    slack = 1e-6 * total
    assert bool((before <= target + slack).all()) and bool((at >= target - slack).all())
    assert bool((p.gather(1, tokens.unsqueeze(1)) > 0).all())


def test_fused_draw_takes_the_inverse_cdf_token_as_the_torch_path_does():
    from workers.draw import draw_probs, uniforms

    kernel = _draw_kernel_or_skip()
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(200, 49157, generator=gen)  # not a multiple of the kernel's chunks or vectors
    logits[torch.rand(logits.shape, generator=gen) < 0.1] = float("-inf")  # banned tokens: zero probability
    lp = torch.log_softmax(logits, -1)
    rows = [row() for _ in range(200)]
    u = uniforms(rows, torch.Generator().manual_seed(9))
    fused = kernel(lp, u)
    torch_path = draw_probs(lp.exp(), rows, torch.Generator().manual_seed(9))  # the same uniforms
    _brackets(lp, u, fused)
    _brackets(lp, u, torch_path)
    # both read the same CDF: only a uniform within float32 rounding of a boundary may pick a neighbour
    assert bool(((fused - torch_path).abs() <= 1).all())


def test_fused_draw_at_the_ends_of_the_cdf_and_in_the_scalar_tail():
    kernel = _draw_kernel_or_skip()
    v = 49157
    lp = torch.full((4, v), float("-inf"))
    lp[0, 1], lp[0, 2] = -0.5, -1.0  # u = 0: the first token that can be drawn, not the banned token 0
    lp[1, 3], lp[1, v - 2] = -1.0, -0.5  # u just under 1: the last token of non-zero probability
    lp[2, v - 1] = 0.0  # all the mass in the vector loops' scalar tail
    lp[3] = torch.log_softmax(torch.zeros(v), -1)  # uniform: u = 0.5 lands mid-vocabulary
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 0.5], dtype=torch.float64)
    assert kernel(lp, u).tolist() == [1, v - 2, v - 1, v // 2]


def test_fused_draw_refuses_what_it_cannot_read():
    kernel = _draw_kernel_or_skip()
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="one contiguous float64 per row"):
        kernel(torch.zeros(2, 8), torch.zeros(3, dtype=torch.float64))


def _mixed_rows(n):
    """Rows of every kind a step can hold: seeded and unseeded draws, greedy, filtered, penalised, with and
    without logprobs (various k) and kept mass."""
    kinds = [dict(), dict(seed=5), dict(temperature=0.0, logprobs=3), dict(top_k=7, logprobs=1),
             dict(temperature=0.7, top_p=0.9, return_sampling_mass=True), dict(seed=9, logprobs=0),
             dict(repetition_penalty=1.3), dict(min_p=0.05, seed=2, logprobs=5)]
    out = []
    for i in range(n):
        kind = dict(kinds[i % len(kinds)])
        seed = kind.pop("seed", None)
        out.append(row(seed=None if seed is None else seed + i, out=(i % 11, 3), **kind))
    return out


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampling_in_spans_gives_every_row_what_the_whole_batch_gives(mode):
    """A wide step samples its rows in spans (so no [S, V] tensor is whole); every reported number and every
    draw, seeded or from the shared generator, is the whole batch's, and a grammar mask follows its row."""
    n, vocab = 53, 300
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 3
    bitmask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32)
    bitmask[:, :4] = 0  # rows 17 and 40 may not take tokens 0..127
    masks = StepMasks([17, 40], bitmask)
    whole = sample(logits, _mixed_rows(n), torch.Generator().manual_seed(11), mode, masks)
    calls = []

    def logits_of(a, b):
        calls.append((a, b))
        return logits[a:b]

    spans = sample_in_spans(logits_of, _mixed_rows(n), torch.Generator().manual_seed(11), mode, lambda: masks,
                            vocab=vocab, span=8)
    assert calls == [(a, min(a + 8, n)) for a in range(0, n, 8)]
    assert torch.equal(spans.token_ids, whole.token_ids)
    assert (spans.token_ids[[17, 40]] >= 128).all()
    for name in ("logprobs", "topk_ids", "topk_logprobs", "sampling_mass"):
        assert torch.equal(getattr(spans, name), getattr(whole, name)), name
    asked = [i for i, r in enumerate(_mixed_rows(n)) if r.params.logprobs is not None]
    assert torch.equal(spans.ranks[asked], whole.ranks[asked])


def test_sampling_spans_keep_the_large_tensors_under_the_heap_limit_and_skip_non_sampling_ranks():
    assert span_rows(49152) * 49152 * 4 <= 16 << 20 and span_rows(49152) >= 64  # SmolLM2: 85 rows
    assert span_rows(262144) == 16  # a huge vocabulary still samples 16 rows at a time
    rows = [row() for _ in range(40)]
    seen = []
    assert sample_in_spans(lambda a, b: seen.append(a) or None, rows, torch.Generator(), vocab=100, span=16) is None
    assert seen == [0, 16, 32]  # a tp rank above 0 still takes part in every span's LM-head gather


# --- logit_bias, allowed_token_ids, bad_words (vLLM's logits processors of a request) ---------------------


def test_logit_bias_moves_the_draw_raw_ignores_it_processed_includes_it():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    bias = {2: 5.0, 0: -100.0}
    for mode in ("raw_logprobs", "processed_logprobs"):
        out = sample(logits, [row(temperature=0.0, logprobs=2, logit_bias=bias)], torch.Generator(), mode)
        assert out.token_ids.tolist() == [2]  # 0.0 + 5 beats 3.0 - 100 and 1.0
        z = logits[0] + torch.tensor([-100.0, 0.0, 5.0, 0.0])
        ref = torch.log_softmax(z if mode.startswith("processed") else logits[0], -1)
        assert torch.allclose(out.logprobs, ref[2:3]) and out.topk_ids.tolist()[0][0] == (2 if "proc" in mode else 0)
    # drawn rows: the processed value and the kept mass obey the contract with the biased logits
    r = row(seed=3, temperature=0.8, top_k=2, logprobs=0, return_sampling_mass=True, logit_bias={3: 4.0})
    proc = sample(logits, [r], torch.Generator(), "processed_logprobs")
    z = (logits[0] + torch.tensor([0.0, 0.0, 0.0, 4.0])) / 0.8
    tok = proc.token_ids.item()
    assert tok in (0, 3)  # top-2 of the biased logits
    contract = torch.log_softmax(z, -1)[tok] - torch.log(proc.sampling_mass)
    assert abs(contract.item() - proc.logprobs.item()) < 1e-5


def test_allowed_token_ids_restrict_the_support_and_renormalise_processed_logprobs():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).repeat(2000, 1)
    rows = [row(allowed_token_ids=[1, 3], logprobs=0, return_sampling_mass=True) for _ in range(2000)]
    out = sample(logits, rows, torch.Generator().manual_seed(0), "processed_logprobs")
    assert set(out.token_ids.tolist()) == {1, 3}
    assert abs((out.token_ids == 1).float().mean().item() - 0.75) < 0.04
    assert torch.allclose(out.sampling_mass, torch.full((2000,), 0.4))
    want = torch.where(out.token_ids == 1, torch.tensor(0.75).log(), torch.tensor(0.25).log())
    assert torch.allclose(out.logprobs, want, atol=1e-6)
    raw = sample(logits[:1], [row(temperature=0.0, allowed_token_ids=[2], logprobs=0)], torch.Generator())
    assert raw.token_ids.tolist() == [2] and abs(raw.logprobs.item() - torch.tensor(0.2).log().item()) < 1e-6


def test_bad_words_ban_the_last_token_once_the_rest_ends_the_output():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    words = [[1], [3, 2]]  # token 1 always; token 2 only right after token 3
    greedy = dict(temperature=0.0, bad_words_token_ids=words)
    assert sample(logits, [row(**greedy)], torch.Generator()).token_ids.tolist() == [2]
    assert sample(logits, [row(out=[3], **greedy)], torch.Generator()).token_ids.tolist() == [3]
    assert sample(logits, [row(out=[3, 0], **greedy)], torch.Generator()).token_ids.tolist() == [2]
    assert sample(logits, [row(prompt=[3], **greedy)], torch.Generator()).token_ids.tolist() == [2]  # output only


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_processed_rows_sample_the_same_bits_alone_and_in_any_batch(mode):
    """A row with a bias, an allowed list or bad words gets the same token, logprobs and mass alone as in a
    batch of other kinds of rows (batch invariance)."""
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(4)) * 2
    kinds = [dict(seed=1, logit_bias={5: 3.0, 7: -2.0}, top_p=0.9),
             dict(seed=2, allowed_token_ids=list(range(0, 200, 3))),
             dict(seed=3, bad_words_token_ids=[[9], [4, 8]], out=[4], temperature=0.7),
             dict(seed=4), dict(temperature=0.0, logit_bias={11: 1.5}), dict(seed=6, top_k=5)]

    def rows():
        return [row(logprobs=3, return_sampling_mass=True, **k) for k in kinds]

    together = sample(logits, rows(), torch.Generator().manual_seed(0), mode)
    for i in range(len(kinds)):
        alone = sample(logits[i:i + 1], rows()[i:i + 1], torch.Generator().manual_seed(0), mode)
        for name in ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "sampling_mass", "ranks"):
            assert torch.equal(getattr(alone, name)[0], getattr(together, name)[i]), (i, name)


# --- --return-sampling-mask: each row's support ------------------------------------------------------------


def _rows_of_mask(out, vocab):
    from engine.sampling_mask import expand

    return expand(out.mask_ids.numpy(), out.mask_counts.numpy(), vocab)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampling_mask_is_the_support_of_the_processed_distribution(mode):
    """Per row, exactly the ids whose processed logprob is finite: the sampled token is always in it, and it
    is the same alone as in any batch."""
    vocab = 300
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(5)) * 3
    kinds = [dict(seed=1, top_k=5), dict(seed=2, top_p=0.8, temperature=0.7), dict(seed=3, min_p=0.2),
             dict(seed=4), dict(temperature=0.0, allowed_token_ids=[3, 9, 11]),
             dict(seed=6, bad_words_token_ids=[[7]], top_k=50), dict(seed=7, logit_bias={2: 50.0}, top_k=3)]

    def rows():
        return [row(logprobs=-1, **k) for k in kinds]

    out = sample(logits, rows(), torch.Generator().manual_seed(0), "processed_logprobs", sampling_mask=True,
                 top=vocab)
    support = _rows_of_mask(out, vocab)
    for i, ids in enumerate(support):
        assert out.token_ids[i].item() in ids, i
        finite = sorted(out.topk_ids[i][out.topk_logprobs[i] > float("-inf")].tolist())
        assert ids == finite, i  # processed_logprobs are -inf exactly outside the mask
    assert len(support[0]) == 5 and support[4] == [3, 9, 11] and 7 not in support[5] and len(support[3]) == vocab
    assert int(out.mask_counts[3]) == -1 and len(support[6]) == 3 and 2 in support[6]  # nothing filtered: one number
    together = sample(logits, rows(), torch.Generator().manual_seed(0), mode, sampling_mask=True)
    for i in range(len(kinds)):
        alone = sample(logits[i:i + 1], rows()[i:i + 1], torch.Generator().manual_seed(0), mode, sampling_mask=True)
        assert torch.equal(alone.token_ids[0], together.token_ids[i])
        assert _rows_of_mask(alone, vocab)[0] == _rows_of_mask(together, vocab)[i] == support[i]


def test_sampling_mask_in_spans_is_the_whole_batchs():
    n, vocab = 21, 120
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(8))
    rows = lambda: [row(seed=i, top_k=1 + i % 7) if i % 3 else row(seed=i) for i in range(n)]  # noqa: E731
    whole = sample(logits, rows(), torch.Generator(), sampling_mask=True)
    spans = sample_in_spans(lambda a, b: logits[a:b], rows(), torch.Generator(), vocab=vocab, span=4,
                            sampling_mask=True)
    assert torch.equal(spans.mask_counts, whole.mask_counts) and torch.equal(spans.mask_ids, whole.mask_ids)
    assert sample(logits, rows(), torch.Generator()).mask_ids is None  # off unless asked
