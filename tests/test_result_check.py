"""engine.scheduler.result_check: a well-typed StepResult that does not fit the step in flight is named."""

from __future__ import annotations

import numpy as np
import pytest

from bus.messages import ErrorInfo, PromptLogprobs, StepResult
from bus.sampling_params import SamplingParams
from engine.request import Sequence
from engine.scheduler.policy import ScheduledStep
from engine.scheduler.result_check import result_problem

pytestmark = pytest.mark.unit


def step(*ids: str) -> ScheduledStep:
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(), [0]) for i in ids]
    return ScheduledStep(seqs, [3] * len(seqs), [0] * len(seqs), seqs, [], 0)


def result(ids, k=2, **kw) -> StepResult:
    n = len(ids)
    return StepResult(1, kw.pop("rank", 0), list(ids), kw.pop("token_ids", np.arange(n)),
                      kw.pop("logprobs", np.zeros(n, np.float32)), kw.pop("topk_ids", np.zeros((n, k), np.int64)),
                      kw.pop("topk_logprobs", np.zeros((n, k), np.float32)), 0, **kw)


def test_what_a_worker_sends_is_accepted():
    st = step("a", "b", "c")
    assert result_problem(result(["a", "c"]), st, 1) is None
    assert result_problem(result(["a", "b", "c"], k=0, ranks=np.ones(3, np.int64),
                                 sampling_mass=np.ones(3, np.float32)), st, 1) is None
    assert result_problem(result([], k=0), st, 1) is None  # only partial prefill chunks
    pl = PromptLogprobs("a", np.zeros(2, np.float32), np.ones(2, np.int64), np.zeros((2, 3), np.int64),
                        np.zeros((2, 3), np.float32))
    assert result_problem(result(["a"], prompt_logprobs=[pl]), st, 1) is None
    routed = np.zeros((4, 2, 2), np.uint8)
    assert result_problem(result(["a"], routed_experts=routed, routed_spans=[("a", 0, 0, 3), ("b", 0, 3, 1)]),
                          st, 1) is None
    mask = dict(sampling_mask_ids=np.array([4, 9, 7], np.int32), sampling_mask_counts=np.array([2, -2], np.int32))
    assert result_problem(result(["a", "b"], **mask), st, 1) is None  # a keeps 4 and 9; b all but 7
    # a failed or interrupted step carries no arrays; other ranks' arrays are not applied
    assert result_problem(StepResult(1, 0, [], None, None, None, None, 0, ErrorInfo("E", "x")), st, 1) is None
    assert result_problem(StepResult(1, 1, ["zz"], None, None, None, None, 0), st, 2) is None


@pytest.mark.parametrize("res, words", [
    (result(["a"], rank=1), "rank 1 does not exist"),
    (result(["a"], rank=-1), "rank -1 does not exist"),
    (result(["a", "zz"]), "did not run"),
    (result(["a", "a"]), "twice"),
    (result(["a", "b"], token_ids=np.arange(1)), "token_ids"),
    (result(["a"], token_ids=np.zeros((1, 1), np.int64)), "token_ids"),
    (result(["a"], token_ids=np.zeros(1, np.float32)), "token_ids"),
    (result(["a"], token_ids=np.array([-4])), "negative"),
    (result(["a"], token_ids=None), "token_ids"),
    (result(["a", "b"], logprobs=np.zeros(3, np.float32)), "logprobs"),
    (result(["a", "b"], topk_ids=np.zeros(2, np.int64)), "topk"),
    (result(["a", "b"], topk_logprobs=np.zeros((2, 5), np.float32)), "topk"),
    (result(["a"], ranks=np.ones(2, np.int64)), "ranks"),
    (result(["a"], sampling_mass=np.ones((1, 1), np.float32)), "sampling_mass"),
    (result(["a"], prompt_logprobs=[PromptLogprobs("zz", np.zeros(2, np.float32), np.ones(2, np.int64),
                                                   np.zeros((2, 1), np.int64), np.zeros((2, 1), np.float32))]),
     "prompt logprobs of a sequence"),
    (result(["a"], prompt_logprobs=[PromptLogprobs("a", np.zeros(2, np.float32), np.ones(3, np.int64),
                                                   np.zeros((2, 1), np.int64), np.zeros((2, 1), np.float32))]),
     "prompt ranks"),
    (result(["a"], routed_experts=np.zeros((2, 1, 1), np.uint8), routed_spans=[("a", 0, 1, 5)]), "outside the rows"),
    (result(["a"], routed_experts=np.zeros((2, 1, 1), np.uint8), routed_spans=[("zz", 0, 0, 1)]), "did not run"),
    (result(["a"], routed_experts=np.zeros(2, np.uint8), routed_spans=[]), "routed experts are not"),
    (result(["a"], routed_spans=[("a", 0, 0, 1)]), "without routed experts"),
    (result(["a"], sampling_mask_ids=np.array([1], np.int32), sampling_mask_counts=np.array([2], np.int32)),
     "announce 2 ids"),
    (result(["a", "b"], sampling_mask_ids=np.zeros(0, np.int32), sampling_mask_counts=np.array([0], np.int32)),
     "sampling_mask_counts"),
    (result(["a"], sampling_mask_ids=np.array([-1], np.int32), sampling_mask_counts=np.array([1], np.int32)),
     "outside the vocabulary"),
    (result(["a"], sampling_mask_counts=np.array([0], np.int32)), "sampling_mask_ids is missing"),
])
def test_a_result_that_does_not_fit_the_step_is_named(res, words):
    why = result_problem(res, step("a", "b"), 1)
    assert why is not None and words in why, why
