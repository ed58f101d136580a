"""Gateway shapes of the training-data features against a scripted engine (no engine processes): echo
with prompt logprobs, prompt_logprobs on completions and chat, kept sampling mass, and the tokens-in /
tokens-out endpoint (403 gating, JSON and SSE, abort, --tokens-only without any tokenizer)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bus.messages import PromptLogprobs
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.serving import ModelInfo
from tests.test_gateway_protocol import EOS, MAX_LEN, VOCAB, CharTokenizer, FakeClient, sse_events

pytestmark = pytest.mark.unit


class LPClient(FakeClient):
    """FakeClient plus what the engine adds for logprob requests: prompt logprobs on the first output
    (token i gets -i/10, rank i, alternatives 33 and 34), rank 2 per sampled token, a kept mass of 0.75."""

    async def generate(self, request_id, prompt_token_ids, params, eos_token_ids, engine=None):
        first = True
        async for out in super().generate(request_id, prompt_token_ids, params, eos_token_ids):
            if first and params.prompt_logprobs is not None:
                n = len(prompt_token_ids) - 1
                k = 2 if params.prompt_logprobs else 0
                out.prompt_logprobs = PromptLogprobs(
                    request_id, np.array([-i / 10 for i in range(1, n + 1)], np.float32),
                    np.arange(1, n + 1, dtype=np.int64), np.tile(np.array([33, 34][:k], np.int64), (n, 1)),
                    np.tile(np.array([-0.25, -3.0][:k], np.float32), (n, 1)))
            first = False
            if params.logprobs is not None and out.token_ids:
                out.ranks = [2]
            if params.return_sampling_mass and out.token_ids:
                out.sampling_mass = [0.75]
            yield out


def app(tokenizer: Any = CharTokenizer(), script: str = "Hi.", **cfg: Any) -> tuple[TestClient, LPClient]:
    client = LPClient(script)
    config = EngineConfig.from_flags(**{"max_logprobs": 5, **cfg})
    info = ModelInfo(names=["tiny"], root="/m", max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=[EOS])
    return TestClient(build_app(config, client, tokenizer, info, manage_client=False),
                      raise_server_exceptions=False), client


def test_echo_with_logprobs_prepends_the_prompt_with_a_null_first_entry() -> None:
    http, _ = app()
    r = http.post("/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 2})
    c = r.json()["choices"][0]
    assert r.status_code == 200, r.text
    assert c["text"] == "abcHi"
    lp = c["logprobs"]
    assert lp["tokens"] == list("abcHi")
    assert lp["token_logprobs"][:3] == [None, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert lp["top_logprobs"][0] is None
    assert list(lp["top_logprobs"][1]) == ["b", "!"]  # the token first, then logprobs=1 alternative
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    pl = c["prompt_logprobs"]
    assert pl[0] is None and len(pl) == 3
    assert pl[2] == {str(ord("c")): {"logprob": pytest.approx(-0.2), "rank": 2, "decoded_token": "c"},
                     "33": {"logprob": -0.25, "rank": 1, "decoded_token": "!"},
                     "34": {"logprob": -3.0, "rank": 2, "decoded_token": '"'}}


def test_echo_with_max_tokens_zero_scores_the_prompt_only() -> None:
    http, client = app()
    body = http.post("/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    c = body["choices"][0]
    assert c["text"] == "abc" and c["logprobs"]["tokens"] == list("abc") and c["finish_reason"] == "length"
    assert client.submitted[0][2].max_tokens == 1 and client.submitted[0][2].prompt_logprobs == 0
    assert body["usage"]["completion_tokens"] == 1  # vLLM counts the one token it generated


def test_echo_stream_puts_the_prompt_in_the_first_chunk_and_token_ids_mode() -> None:
    http, _ = app()
    r = http.post("/v1/completions", json={"prompt": [ord("x"), ord("y")], "echo": True, "logprobs": 0,
                                           "max_tokens": 2, "stream": True, "return_tokens_as_token_ids": True})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("xyH")
    assert first["logprobs"]["tokens"][:3] == [f"token_id:{ord('x')}", f"token_id:{ord('y')}", f"token_id:{ord('H')}"]
    assert first["logprobs"]["token_logprobs"][0] is None
    # vLLM: each offset adds the length of the previous token's label
    assert first["logprobs"]["text_offset"][:2] == [0, len(f"token_id:{ord('x')}")]
    assert all(c["choices"][0]["logprobs"]["token_logprobs"][0] is not None for c in chunks[1:])


def test_chat_prompt_logprobs_all_top_logprobs_and_mass() -> None:
    http, client = app(max_logprobs=-1)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": -1, "prompt_logprobs": 1,
                                                "return_sampling_mass": True, "top_p": 0.5})
    body = r.json()
    assert r.status_code == 200, body
    assert client.submitted[0][2].logprobs == -1 and client.submitted[0][2].return_sampling_mass
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(client.submitted[0][1])
    choice = body["choices"][0]
    assert choice["sampling_mass"] == [0.75, 0.75] and choice["routed_experts"] is None
    # -1: every alternative the engine sent (the fake sends two, plus the token itself first)
    assert [t["token"] for t in choice["logprobs"]["content"][0]["top_logprobs"]] == ["H", "!"]


def test_generate_is_403_unless_scale_out_is_on(monkeypatch) -> None:
    http, _ = app()
    for path, body in (("/inference/v1/generate", {"token_ids": [1, 2]}),
                       ("/inference/v1/abort_requests", {"request_ids": ["x"]})):
        r = http.post(path, json=body)
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError", r.text
    monkeypatch.setenv("VLLM_ENABLE_SCALE_OUT_ENDPOINTS", "1")
    http, _ = app()
    assert http.post("/inference/v1/generate", json={"token_ids": [1, 2]}).status_code == 200


def test_generate_response_shape() -> None:
    http, client = app(enable_scale_out=True)
    r = http.post("/inference/v1/generate", headers={"X-Request-Id": "abc"}, json={
        "token_ids": [5, 6, 7], "return_token_ids": True,
        "sampling_params": {"max_tokens": 2, "logprobs": 2, "prompt_logprobs": 1, "return_sampling_mass": True,
                            "top_k": 3}})
    body = r.json()
    assert r.status_code == 200, body
    assert body["request_id"] == "generate-tokens-abc" and body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == [5, 6, 7] and body["prompt_logprobs"][0] is None
    c = body["choices"][0]
    assert c["token_ids"] == [ord("H"), ord("i")] and c["finish_reason"] == "length" and c["stop_reason"] is None
    assert c["routed_experts"] is None and c["sampling_mask"] is None and c["sampling_mass"] == [0.75, 0.75]
    assert [(w["start"], w["end"]) for w in c["weight_versions"]] == [(0, 2)]  # always on for this endpoint
    first = c["logprobs"]["content"][0]
    # the token first (with its engine rank), then alternatives: max(k, 1) entries in all
    assert first == {"token_id": ord("H"), "logprob": -0.5, "rank": 2, "top_logprobs": [
        {"token_id": ord("H"), "logprob": -0.5, "rank": 2}, {"token_id": 33, "logprob": -1.5, "rank": 2}]}
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    params = client.submitted[0][2]
    assert client.submitted[0][0] == "generate-tokens-abc-0" and params.temperature == 1.0  # engine defaults


def test_generate_max_tokens_default_is_the_rest_of_the_context_and_stream() -> None:
    http, client = app(enable_scale_out=True, script="Hello world")
    r = http.post("/inference/v1/generate", json={"token_ids": [5], "stream": True, "return_token_ids": True,
                                                  "stream_options": {"include_usage": True},
                                                  "sampling_params": {"logprobs": 0}})
    events = sse_events(r.text)
    assert client.submitted[0][2].max_tokens == MAX_LEN - 1
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    assert chunks[0]["prompt_token_ids"] == [5] and "prompt_token_ids" not in chunks[1]
    assert [c["choices"][0]["token_ids"] for c in chunks][:2] == [[ord("H")], [ord("e")]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["weight_versions"]
    assert chunks[0]["choices"][0]["weight_versions"] is None
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token_id": ord("H"), "logprob": -0.5, "rank": 2}]


def test_trace_replay_needs_the_flag_and_normalises_the_request() -> None:
    http, _ = app(enable_scale_out=True)
    r = http.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": {
        "trace_decode_token_ids": [65, 66]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.trace_decode_token_ids"
    assert "--enable-trace-replay" in r.json()["error"]["message"]
    http, client = app(enable_scale_out=True, enable_trace_replay=True)
    r = http.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": {
        "trace_decode_token_ids": [65, 66, 67], "max_tokens": 30, "stop_token_ids": [66], "min_tokens": 1}})
    assert r.status_code == 200, r.text
    p = client.submitted[0][2]
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (3, 0, True, [])
    http.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": {
        "trace_decode_token_ids": [65] * 100}})
    assert len(client.submitted[1][2].trace_decode_token_ids) == MAX_LEN - 1  # cut to fit the context


def test_abort_requests() -> None:
    http, _ = app(enable_scale_out=True)
    assert http.post("/inference/v1/abort_requests", json={}).status_code == 400
    r = http.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-x"]})
    assert r.status_code == 200 and r.content == b""


class Tripwire:
    """A tokenizer that fails the request the moment anything but its EOS ids (read at start-up) is used."""

    eos_token_ids = [EOS]

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"tokenizer.{name} used on the request path")


def test_tokens_only_never_needs_a_tokenizer() -> None:
    http, client = app(tokenizer=None, tokens_only=True)
    r = http.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {
        "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 3}})
    body = r.json()
    assert r.status_code == 200, body
    assert body["prompt_logprobs"][1][str(6)]["decoded_token"] is None
    assert http.app.state.serving.eos_token_ids == [EOS]  # from the model's configs, not a tokenizer
    r = http.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": {"stop": ["x"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop"
    r = http.post("/v1/completions", json={"prompt": "text", "max_tokens": 2})
    assert r.status_code == 400 and "--tokens-only" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_tokens_as_token_ids"
    r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "logprobs": 1,
                                           "return_tokens_as_token_ids": True, "return_token_ids": True})
    c = r.json()["choices"][0]
    assert r.status_code == 200 and c["text"] == "" and c["token_ids"] == [ord("H"), ord("i")]
    # with a tokenizer loaded, the generate endpoint still never calls it (no stop strings asked)
    http, _ = app(tokenizer=Tripwire(), enable_scale_out=True)
    r = http.post("/inference/v1/generate", json={"token_ids": [5, 6], "stream": True,
                                                  "sampling_params": {"logprobs": 2, "max_tokens": 3}})
    assert r.status_code == 200 and "error" not in r.text, r.text
    r = http.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 500  # the tripwire works
