"""Gateway HTTP tests against a scripted fake EngineClient (no engine processes): several prompts x n,
seeds, stop strings aborting the engine request, SSE framing, chat templates, /v1/models, /health, /metrics.
"""

from __future__ import annotations

import pytest

from tests.test_gateway_protocol import MAX_LEN, FakeClient, make_app, sse_events
from tests.waits import wait_for

pytestmark = pytest.mark.unit


def test_completions_several_prompts_and_n() -> None:
    http, client = make_app()
    r = http.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "seed": 10, "max_tokens": 5,
                                           "logprobs": 1, "return_token_ids": True}, headers={"X-Request-Id": "q"})
    body = r.json()
    assert r.status_code == 200, body
    assert body["id"] == "cmpl-q" and body["object"] == "text_completion" and body["model"] == "tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello" and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23,
                             "prompt_tokens_details": {"cached_tokens": 6}}
    ids = sorted(s[0] for s in client.submitted)
    assert ids == ["cmpl-q-0", "cmpl-q-1", "cmpl-q-2", "cmpl-q-3"]
    seeds = {s[0]: s[2].seed for s in client.submitted}
    assert (seeds["cmpl-q-0"], seeds["cmpl-q-1"], seeds["cmpl-q-2"], seeds["cmpl-q-3"]) == (10, 11, 10, 11)
    assert body["choices"][2]["prompt_token_ids"] == [ord("c")]
    assert body["choices"][0]["logprobs"]["tokens"] == list("Hello")
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]


def test_stop_string_aborts_engine_request() -> None:
    http, client = make_app()
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": [" wor"]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("Hello", "stop", " wor")
    assert client.aborted == [client.submitted[0][0]]


def test_eos_finish_and_stop_token() -> None:
    http, _ = make_app()
    c = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40}).json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("Hello world. Bye.", "stop", None)
    c = http.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [ord(".")]}).json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("Hello world", "stop", ord("."))


def test_completions_stream() -> None:
    http, _ = make_app()
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True, "n": 2,
                                           "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == "Hel"
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]


def test_chat_stream_and_non_stream() -> None:
    http, _ = make_app()
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "stream": True,
                                                "logprobs": True, "top_logprobs": 2})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    first, *rest = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == "Hell"
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in rest[:-1])
    assert len(rest[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    body = http.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 5}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == "Hello" and body["choices"][0]["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>")


def test_client_disconnect_aborts_stream() -> None:
    client = FakeClient(script="x" * 50, delay=0.01)
    http, client = make_app(client)
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # read one chunk, then hang up
    wait_for(lambda: client.aborted, 5, "the engine request's abort")
    assert client.aborted == [client.submitted[0][0]]


def test_models_health_version_metrics() -> None:
    http, client = make_app()
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert models["data"][0]["max_model_len"] == MAX_LEN and models["data"][0]["owned_by"] == "rollbus"
    assert models["data"][0]["root"] == "/models/tiny"
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.post("/ping").status_code == 200
    client.health_ok = False
    assert http.get("/health").status_code == 503
    assert "version" in http.get("/version").json()
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "tiny-alias"})
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    from tests.test_gateway_metrics import labels, samples

    got, tiny = samples(text), labels(model="tiny")
    assert got["vllm:num_requests_running", tiny] == 2.0
    assert got["vllm:kv_cache_usage_perc", tiny] == 0.25
    assert got["vllm:generation_tokens_total", tiny] == 2.0
    assert got["vllm:request_success_total", labels(model="tiny", finished_reason="length")] == 1.0
    assert '# TYPE vllm:e2e_request_latency_seconds histogram' in text
    assert got["vllm:e2e_request_latency_seconds_bucket", labels(model="tiny", le="+Inf")] == 1


def test_chat_template_features() -> None:
    http, client = make_app()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "add_generation_prompt": False,
                                                "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert client.submitted[-1][1] == [ord(ch) for ch in "<user>hi\n<assistant>Hel"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "1", "tool_call_id": "a"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "tool message without tools" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "1", "tool_call_id": "a"}],
                                                "tools": tools, "tool_choice": "none", "max_tokens": 1})
    assert r.status_code == 200, r.text  # tools rendered into the prompt; tool calls are not parsed (yet)


def test_metrics_exposition_is_well_formed() -> None:
    import re

    http, _ = make_app()
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    client_stats = {"steps": 4, "step_time_total": 0.2, "num_preemptions": 1, "odd-key": 3}
    http.app.state.serving.client.stats.update(client_stats)  # type: ignore[attr-defined]
    text = http.get("/metrics").text
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="[^"]*",?)*\})? [-+0-9.eE]+|[-+]Inf|NaN$')
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            assert name not in typed, f"duplicate TYPE for {name}"
            typed.add(name)
        elif not line.startswith("# HELP "):
            assert sample.match(line), line
    assert "vllm:num_preemptions_total" in typed and "rollbus_step_latency_seconds" in typed
    from tests.test_gateway_metrics import labels, samples

    assert samples(text)["rollbus_step_latency_seconds_count", labels(model="tiny")] == 4.0
    assert "rollbus_odd_key" in text
