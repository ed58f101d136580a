import torch

from engine.sampling_params import SamplingParams
from workers.sampler import RowState, sample


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
