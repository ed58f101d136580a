"""/metrics through prometheus_client: latency histograms from known token times (inter-token latency
is one observation per gap, so a stall shows in the tail), and the app's exposition (vLLM's labels, the
sleep state, errors, content negotiation) against a scripted engine."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from bus.messages import ControlState, RequestOutput
from bus.sampling_params import SamplingParams
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.choice_state import ChoiceState
from gateway.metrics import ITL_BUCKETS, Metrics
from gateway.serving import ModelInfo
from tests.test_gateway_protocol import EOS, MAX_LEN, VOCAB, CharTokenizer, FakeClient

pytestmark = pytest.mark.unit


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics text -> {(sample name, sorted labels): value}, whatever order the exposition writes."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def labels(model: str = "m", **extra: str) -> tuple[tuple[str, str], ...]:
    """The sorted label set of a sample: vLLM's model_name and engine, plus `extra`."""
    return tuple(sorted({"model_name": model, "engine": "0", **extra}.items()))


def delta(tokens: list[int], finished: bool = False, cached: int = 0) -> RequestOutput:
    return RequestOutput(request_id="r-0", token_ids=tokens, logprobs=None, top_logprobs=None, finished=finished,
                         finish_reason="length" if finished else None, stop_reason=None, error=None,
                         num_prompt_tokens=3, num_cached_tokens=cached, weight_epoch=0)


def run(metrics: Metrics, arrival: float, deltas: list[tuple[float, list[int]]], end: float) -> ChoiceState:
    """Feed one choice its deltas at the given times, recording metrics as serving._run_choice does."""
    state = ChoiceState(0, "r-0", [1, 2, 3], SamplingParams(max_tokens=99), None)
    state.arrival = arrival
    for i, (at, tokens) in enumerate(deltas):
        metrics.observe_delta(state, state.feed(delta(tokens, i == len(deltas) - 1), now=at))
    metrics.observe_choice(state, now=end)
    return state


def test_inter_token_latency_is_one_observation_per_gap() -> None:
    m = Metrics("m")
    # first token 0.5 s after arrival, then gaps of 20 ms, 20 ms, a 1 s stall, 20 ms
    run(m, 100.0, [(100.5, [7]), (100.52, [8]), (100.54, [9]), (101.54, [10]), (101.56, [11])], end=101.6)
    got = samples(m.render())
    assert got["vllm:inter_token_latency_seconds_count", labels()] == 4
    assert got["vllm:inter_token_latency_seconds_sum", labels()] == pytest.approx(1.06)
    buckets = {le: got["vllm:inter_token_latency_seconds_bucket", labels(le=str(le))] for le in ITL_BUCKETS}
    # three fast gaps under 25 ms, the stall alone between 0.75 s and 1 s (a per-request mean of 0.265 s,
    # recorded four times, would put all four between 0.2 s and 0.3 s and hide both)
    assert buckets[0.01] == 0 and buckets[0.025] == 3 and buckets[0.75] == 3 and buckets[1.0] == 4
    assert got["vllm:time_to_first_token_seconds_count", labels()] == 1
    assert got["vllm:time_to_first_token_seconds_sum", labels()] == pytest.approx(0.5)
    # vLLM's per-request mean: decode time over the tokens after the first
    assert got["vllm:request_time_per_output_token_seconds_sum", labels()] == pytest.approx(1.06 / 4)
    assert got["vllm:request_time_per_output_token_seconds_count", labels()] == 1
    assert got["vllm:e2e_request_latency_seconds_sum", labels()] == pytest.approx(1.6)
    assert got["vllm:generation_tokens_total", labels()] == 5
    assert got["vllm:request_success_total", labels(finished_reason="length")] == 1


def test_a_delta_with_several_tokens_is_one_gap_and_an_empty_delta_none() -> None:
    m = Metrics("m")
    run(m, 0.0, [(0.1, [7]), (0.2, [8, 9, 10]), (0.3, [])], end=0.3)  # vLLM: one ITL per engine step
    got = samples(m.render())
    assert got["vllm:inter_token_latency_seconds_count", labels()] == 1
    assert got["vllm:inter_token_latency_seconds_sum", labels()] == pytest.approx(0.1)
    assert got["vllm:request_time_per_output_token_seconds_sum", labels()] == pytest.approx(0.1 / 3)


def test_a_request_without_tokens_has_no_ttft_and_one_token_a_zero_tpot() -> None:
    m = Metrics("m")
    run(m, 0.0, [(0.5, [])], end=0.5)
    run(m, 0.0, [(0.5, [7])], end=0.5)
    got = samples(m.render())
    assert got["vllm:time_to_first_token_seconds_count", labels()] == 1
    assert got["vllm:inter_token_latency_seconds_count", labels()] == 0
    assert got["vllm:request_time_per_output_token_seconds_count", labels()] == 1
    assert got["vllm:request_time_per_output_token_seconds_bucket", labels(le="0.01")] == 1
    assert got["vllm:e2e_request_latency_seconds_count", labels()] == 2


def test_prefix_cache_counts_a_request_once_when_admitted_as_vllm_does() -> None:
    """vLLM records a request's prefix-cache lookup when the scheduler admits it: an admitted request counts its
    prompt once (its cached tokens as hits), one aborted before admission (no engine output) nothing, and a
    prompt_logprobs request, which skips the cache, nothing."""
    m = Metrics("m")
    state = ChoiceState(0, "r-0", [1, 2, 3], SamplingParams(max_tokens=99), None)
    for i, tokens in enumerate([[7], [8], [9]]):
        m.observe_delta(state, state.feed(delta(tokens, i == 2, cached=2), now=float(i)))
        got = samples(m.render())
        assert got["vllm:prefix_cache_queries_total", labels()] == 3  # from the first output on, once
        assert got["vllm:prefix_cache_hits_total", labels()] == 2
    m.observe_choice(state, now=3.0)
    never = ChoiceState(0, "r-1", [1, 2, 3, 4], SamplingParams(max_tokens=99), None)
    m.observe_choice(never, now=3.0)  # aborted while waiting
    plp = ChoiceState(0, "r-2", [1, 2, 3, 4], SamplingParams(max_tokens=99, prompt_logprobs=1), None)
    m.observe_delta(plp, plp.feed(delta([7], True), now=1.0))
    m.observe_choice(plp, now=1.0)
    got = samples(m.render())
    assert got["vllm:prefix_cache_queries_total", labels()] == 3 and got["vllm:prefix_cache_hits_total", labels()] == 2
    assert got["vllm:request_success_total", labels(finished_reason="abort")] == 1


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, FakeClient]:
    client = FakeClient("Hi")
    client.control_state = ControlState()
    info = ModelInfo(names=["m"], root="/m", max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=[EOS])
    app = build_app(EngineConfig(), client, CharTokenizer(), info, manage_client=False)
    return TestClient(app, raise_server_exceptions=False), client


def test_each_request_through_the_app_records_its_gaps(served: tuple[TestClient, FakeClient]) -> None:
    http, _ = served
    before = samples(http.get("/metrics").text)
    for n in (1, 2):  # "Hi" + EOS: three deltas of one token, two gaps per choice
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 5, "n": n}).status_code == 200
    got = samples(http.get("/metrics").text)

    def added(name: str, **extra: str) -> float:
        return got[name, labels(**extra)] - before[name, labels(**extra)]
    assert added("vllm:inter_token_latency_seconds_count") == 2 * 3
    assert added("vllm:time_to_first_token_seconds_count") == 3
    assert added("vllm:request_time_per_output_token_seconds_count") == 3
    assert added("vllm:request_success_total", finished_reason="stop") == 3
    assert added("vllm:prompt_tokens_total") == 3


def test_errors_count_in_vllms_finished_reason_and_ours(served: tuple[TestClient, FakeClient]) -> None:
    http, client = served
    before = samples(http.get("/metrics").text)
    client.fail_after = 1
    try:
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 5}).status_code == 500
    finally:
        client.fail_after = None
    got = samples(http.get("/metrics").text)
    for key in (("vllm:request_success_total", labels(finished_reason="error")),
                ("rollbus_request_errors_total", labels())):
        assert got[key] - before[key] == 1


def test_sleep_state_and_health_are_read_at_scrape_time(served: tuple[TestClient, FakeClient]) -> None:
    http, client = served
    state = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    got = samples(http.get("/metrics").text)
    assert {s: got["vllm:engine_sleep_state", labels(sleep_state=s)] for s in state} == state
    client.control_state = ControlState(sleep_level=2, sleeping_tags=["weights", "kv_cache"])
    try:
        got = samples(http.get("/metrics").text)
    finally:
        client.control_state = ControlState()
    assert {s: got["vllm:engine_sleep_state", labels(sleep_state=s)] for s in state} == \
        {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    assert got["rollbus_engine_healthy", labels()] == 1.0


def test_openmetrics_when_the_scraper_asks_for_it(served: tuple[TestClient, FakeClient]) -> None:
    http, _ = served
    r = http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n") and "# TYPE vllm:prompt_tokens counter" in r.text
    plain = http.get("/metrics")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE vllm:prompt_tokens_total counter" in plain.text
