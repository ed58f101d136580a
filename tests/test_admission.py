"""engine/scheduler/admission.py: what the scheduler refuses of an AddRequest that came over the bus
(pure function, no sockets). The live check over real sockets is in tests/test_bus_bad_input.py."""

from __future__ import annotations

import math

import pytest

from bus.messages import AddRequest
from bus.sampling_params import SamplingParams
from engine.scheduler.admission import EngineLimits, admission_error

pytestmark = pytest.mark.unit

LIMITS = EngineLimits(vocab_size=100, max_model_len=64, max_logprobs=5)


def req(prompt=(1, 2, 3), eos=(0,), **sampling) -> AddRequest:
    return AddRequest("r", list(prompt), SamplingParams(**{"max_tokens": 8, **sampling}), list(eos), 0.0)


# (what is wrong, the request, the param the error must name, a word its message must hold)
BAD = [
    ("empty prompt", req(prompt=()), "prompt_token_ids", "empty"),
    ("id = vocab size", req(prompt=(1, 100)), "prompt_token_ids", "100"),
    ("negative id", req(prompt=(-1, 5)), "prompt_token_ids", "-1"),
    ("huge id", req(prompt=(2**63,)), "prompt_token_ids", "vocabulary"),
    ("prompt = max_model_len", req(prompt=[1] * 64), "prompt_token_ids", "max_model_len"),
    ("eos id outside", req(eos=(0, 100)), "eos_token_ids", "100"),
    ("negative eos id", req(eos=(-3,)), "eos_token_ids", "-3"),
    ("max_tokens 0", req(max_tokens=0), "sampling.max_tokens", "at least 1"),
    ("max_tokens negative", req(max_tokens=-5), "sampling.max_tokens", "at least 1"),
    ("max_tokens past the context", req(max_tokens=62), "sampling.max_tokens", "max_model_len"),
    ("max_tokens huge", req(max_tokens=2**63), "sampling.max_tokens", "max_model_len"),
    ("n 0", req(n=0), "sampling.n", "n must"),
    ("n huge", req(n=10**6), "sampling.n", "n must"),
    ("logprobs above --max-logprobs", req(logprobs=6), "sampling.logprobs", "max allowed"),
    ("logprobs -2", req(logprobs=-2), "sampling.logprobs", "-1"),
    ("prompt_logprobs above the cap", req(prompt_logprobs=50), "sampling.prompt_logprobs", "max allowed"),
    ("temperature nan", req(temperature=math.nan), "sampling.temperature", "finite"),
    ("temperature inf", req(temperature=math.inf), "sampling.temperature", "finite"),
    ("temperature negative", req(temperature=-0.1), "sampling.temperature", ">= 0"),
    ("top_p 0", req(top_p=0.0), "sampling.top_p", "top_p"),
    ("top_p nan", req(top_p=math.nan), "sampling.top_p", "top_p"),
    ("top_p above 1", req(top_p=1.5), "sampling.top_p", "top_p"),
    ("top_k -2", req(top_k=-2), "sampling.top_k", "top_k"),
    ("min_p 2", req(min_p=2.0), "sampling.min_p", "min_p"),
    ("presence_penalty inf", req(presence_penalty=math.inf), "sampling.presence_penalty", "[-2, 2]"),
    ("frequency_penalty nan", req(frequency_penalty=math.nan), "sampling.frequency_penalty", "[-2, 2]"),
    ("repetition_penalty 0", req(repetition_penalty=0.0), "sampling.repetition_penalty", "> 0"),
    ("min_tokens above max_tokens", req(min_tokens=9), "sampling.min_tokens", "<="),
    ("stop id outside", req(stop_token_ids=[100]), "sampling.stop_token_ids", "100"),
    ("seed beyond 64 bits", req(seed=2**63), "sampling.seed", "64 bits"),
    ("routed experts start past the prompt", req(routed_experts_prompt_start=4),
     "sampling.routed_experts_prompt_start", "[0, 3]"),
    ("trace replay not enabled", req(trace_decode_token_ids=[1, 2]), "sampling.trace_decode_token_ids",
     "--enable-trace-replay"),
]


@pytest.mark.parametrize("what,request_,param,word", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_refused_naming_the_field(what, request_, param, word):
    e = admission_error(request_, LIMITS)
    assert e is not None, what
    assert e.param == param and e.status == 400, e
    assert word in e.message, e.message


def test_trace_replay_ids_are_checked_when_enabled():
    limits = EngineLimits(100, 64, 5, enable_trace_replay=True)
    assert admission_error(req(trace_decode_token_ids=[1, 2]), limits) is None
    e = admission_error(req(trace_decode_token_ids=[1, 100]), limits)
    assert e is not None and e.param == "sampling.trace_decode_token_ids" and "out-of-vocab" in e.message


GOOD = [
    req(),
    req(prompt=[99] * 63, max_tokens=1),  # the last id, the whole context
    req(prompt=[0], max_tokens=None, eos=()),  # no max_tokens: the rest of the context
    req(temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0, logprobs=5, prompt_logprobs=0),
    req(top_k=10**9, n=128, seed=-(2**63), presence_penalty=-2, frequency_penalty=2, repetition_penalty=100.0),
    req(routed_experts_prompt_start=3, stop_token_ids=[0, 99], min_tokens=8),
]


@pytest.mark.parametrize("request_", GOOD)
def test_requests_the_gateway_would_send_are_admitted(request_):
    assert admission_error(request_, LIMITS) is None


def test_whole_vocabulary_logprobs_need_max_logprobs_minus_one():
    assert admission_error(req(logprobs=-1), LIMITS).param == "sampling.logprobs"
    assert admission_error(req(logprobs=-1, prompt_logprobs=-1), EngineLimits(100, 64, -1)) is None
