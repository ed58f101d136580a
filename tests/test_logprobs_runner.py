"""ModelRunner's prompt logprobs and trace replay on a tiny model against HF transformers, driven by
hand-written step plans: chunked prefill, a batch-mate, and a recompute after preemption (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bus.messages import NewSeq, StepPlan
from bus.sampling_params import SamplingParams
from tests.tiny_models import load_model, make_tiny_checkpoint
from workers.kv_cache import KVCache
from workers.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return load_model(folder), hf


def _runner(model, mode="raw_logprobs"):
    kv = KVCache(*model.kv_spec, BS, 64, torch.float32, torch.device("cpu"))
    return ModelRunner(model, kv, rank=0, block_size=BS, device=torch.device("cpu"), logprobs_mode=mode)


def _plan(step, new, ids, computed, new_n, tables):
    return StepPlan(step, new, ids, computed, new_n, tables, [], 0)


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_across_chunks_and_a_recompute(tiny):
    model, hf = tiny
    prompt = [(17 * j + 3) % 1500 for j in range(13)]
    other = [5, 6, 7]
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, logprobs=2)
    r = _runner(model)
    table = list(range(4))
    new = [NewSeq("a", prompt, sp, []), NewSeq("b", other, SamplingParams(temperature=0.0), [])]
    res = r.execute(_plan(1, new, ["a", "b"], [0, 0], [5, 3], [table, [10]]))
    assert res.seq_ids == ["b"] and res.prompt_logprobs == []  # a's rows are kept until it is sampled
    # preempted after its first chunk: recomputed from 0, and its first rows are not reported twice
    r.execute(_plan(2, [], ["a"], [0], [9], [table]))
    res = r.execute(_plan(3, [], ["a"], [9], [4], [table]))
    assert res.seq_ids == ["a"] and len(res.prompt_logprobs) == 1
    pl = res.prompt_logprobs[0]
    ref = _hf_logprobs(hf, prompt)
    want = np.array([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))])
    assert pl.logprobs.shape == (12,) and np.abs(pl.logprobs - want).max() < 1e-4
    want_ranks = [int((ref[i - 1] >= ref[i - 1, prompt[i]]).sum()) for i in range(1, len(prompt))]
    assert pl.ranks.tolist() == want_ranks
    assert pl.topk_ids.tolist() == ref[:-1].topk(3).indices.tolist()
    assert res.ranks.tolist() == [1]  # greedy
    res = r.execute(_plan(4, [], ["a"], [13], [1], [table]))
    assert res.prompt_logprobs == []  # sent once


def test_one_token_prompt_has_no_rows(tiny):
    model, _ = tiny
    r = _runner(model)
    sp = SamplingParams(temperature=0.0, prompt_logprobs=0)
    res = r.execute(_plan(1, [NewSeq("x", [9], sp, [])], ["x"], [0], [1], [[0]]))
    assert res.prompt_logprobs[0].logprobs.shape == (0,) and res.prompt_logprobs[0].topk_ids.shape == (0, 0)


def test_trace_replay_forces_tokens_and_reports_teacher_forced_logprobs(tiny):
    model, hf = tiny
    prompt, trace = [11, 22, 33, 44, 55], [7, 700, 1499, 3]
    sp = SamplingParams(temperature=1.0, seed=0, logprobs=1, max_tokens=4, trace_decode_token_ids=trace)
    r = _runner(model)
    table = [0, 1, 2]
    got, lps, ranks = [], [], []
    res = r.execute(_plan(1, [NewSeq("t", prompt, sp, [])], ["t"], [0], [5], [table]))
    for step in range(len(trace)):
        got += res.token_ids.tolist()
        lps += res.logprobs.tolist()
        ranks += res.ranks.tolist()
        if step + 1 < len(trace):
            res = r.execute(_plan(step + 2, [], ["t"], [5 + step], [1], [table]))
    assert got == trace
    ref = _hf_logprobs(hf, prompt + trace)
    want = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(trace)]
    assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4
    assert ranks == [int((ref[len(prompt) - 1 + i] >= ref[len(prompt) - 1 + i, t]).sum()) for i, t in enumerate(trace)]


def test_an_id_reused_right_after_it_finished(tiny):
    """The plan that forgets a finished request may bring a new one with the same id (clients choose ids)."""
    model, _ = tiny
    r = _runner(model)
    sp = SamplingParams(temperature=0.0)
    r.execute(_plan(1, [NewSeq("x", [1, 2, 3], sp, [])], ["x"], [0], [3], [[0]]))
    res = r.execute(StepPlan(2, [NewSeq("x", [4, 5], sp, [])], ["x"], [0], [2], [[1]], ["x"], 0))
    assert res.seq_ids == ["x"]
