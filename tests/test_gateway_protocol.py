"""Gateway tests that need no engine: request models, prompt validation, stop strings, logprob shapes,
the error envelope (replaying tests/gateway_bad_inputs.py). Also home of the fakes (a character
tokenizer, a scripted EngineClient) that tests/test_gateway_fake_engine.py shares.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest
from fastapi.testclient import TestClient

from bus.messages import CommandBody, ControlReply, ControlState, ErrorInfo, HealthReport, RequestOutput
from bus.sampling_params import ParamError, SamplingParams
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.choice_state import ChoiceState, find_stop
from gateway.limits import TOO_LARGE
from gateway.metrics import Metrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving import ModelInfo, ServingContext
from gateway.serving_chat import chat_logprobs
from gateway.serving_completions import completion_logprobs
from tests.gateway_bad_inputs import bad_input_cases

pytestmark = pytest.mark.unit

EOS, BOS, VOCAB, MAX_LEN = 0, 1, 128, 64


class CharTokenizer:
    """One token per ASCII character; 0 = <eos>, 1 = <bos> (both special)."""

    vocab_size = VOCAB
    eos_token_ids: ClassVar[list[int]] = [EOS]
    bos_token_id = BOS
    _special: ClassVar[dict[int, str]] = {EOS: "<eos>", BOS: "<bos>"}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else self._special[i]) if i in self._special else chr(i)
                       for i in ids)

    def token_to_id(self, token: str) -> int | None:
        special = {t: i for i, t in self._special.items()}
        return special.get(token, ord(token) if len(token) == 1 else None)  # else one character a token

    def id_to_token(self, i: int) -> str:
        return self._special.get(i) or chr(i)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Any = None, **kw: Any) -> str:
        if any(m["role"] == "tool" for m in messages) and not tools:
            raise ValueError("tool message without tools")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def new_detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> CharDetok:
        return CharDetok(self, skip_special_tokens)


class CharDetok:
    def __init__(self, tok: CharTokenizer, skip: bool):
        self.tok, self.skip, self.text = tok, skip, ""

    def push(self, ids: list[int]) -> str:
        delta = self.tok.decode(ids, self.skip)
        self.text += delta
        return delta


class FakeClient:
    """Generates `script` one character per delta (then EOS); records what was submitted and aborted."""

    name = "gateway-test"

    def __init__(self, script: str = "Hello world. Bye.", delay: float = 0.0):
        self.script, self.delay = script, delay
        self.stats: dict[str, float] = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "step_time_s": 0.01}
        self.dead_reason: str | None = None
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.fail_after: int | None = None
        self.failure = ErrorInfo("StepFailed", "worker exploded")  # what a request ends with after fail_after
        self.health_ok = True

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    rejecting_new_requests = False
    paused = False
    control_state = ControlState()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def control(self, command: CommandBody, timeout_s: float = 0.0) -> ControlReply:
        acks = {"scheduler": HealthReport(True), "worker-0": HealthReport(True)} if self.health_ok else {}
        errors = [] if self.health_ok else [ErrorInfo("RuntimeError", "silent", "worker-0")]
        return ControlReply("x", self.health_ok, 1, acks, errors)

    def pick_engine(self, requested: int | None, reservations: list[tuple[str, int]]) -> int:
        return 0  # one engine

    def release(self, request_ids: list[str]) -> None:
        pass

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: list[int], engine: int | None = None) -> AsyncIterator[RequestOutput]:
        self.submitted.append((request_id, prompt_token_ids, params))
        tokens = [ord(ch) for ch in self.script] + [EOS]
        finished = False
        try:
            for k, tid in enumerate(tokens):
                await asyncio.sleep(self.delay)
                n = k + 1
                lp = None if params.logprobs is None else [-0.5]
                top = None if params.logprobs is None else [[[tid, -0.5], [33, -1.5], [34, -2.5]][:params.logprobs]]
                if self.fail_after is not None and k == self.fail_after:
                    finished = True
                    yield RequestOutput(request_id, [], None, None, True, "error", None, self.failure,
                                        len(prompt_token_ids), 0, 0)
                    return
                reason = stop_reason = None
                if tid in params.stop_token_ids:
                    reason, stop_reason = "stop", tid
                elif tid == EOS and not params.ignore_eos:
                    reason = "stop"
                elif n >= params.max_tokens:
                    reason = "length"
                finished = reason is not None
                yield RequestOutput(request_id, [tid], lp, top, finished, reason, stop_reason, None,
                                    len(prompt_token_ids), 3, 0)
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)


def make_app(client: FakeClient | None = None, **cfg_kw: Any) -> tuple[TestClient, FakeClient]:
    client = client or FakeClient()
    cfg = EngineConfig.from_flags(max_logprobs=5, **cfg_kw)
    info = ModelInfo(names=["tiny", "tiny-alias"], root="/models/tiny", max_model_len=MAX_LEN, vocab_size=VOCAB)
    app = build_app(cfg, client, CharTokenizer(), info, manage_client=False)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False), client


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- request models ------------------------------------------------------------------------------


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[5, 6]).prompts() == [[5, 6]]
    assert CompletionRequest(prompt=[[5], [6, 7]]).prompts() == [[5], [6, 7]]
    with pytest.raises(ParamError) as e:
        CompletionRequest(prompt=[]).prompts()
    assert e.value.param == "prompt"


def test_max_tokens_defaults_follow_vllm() -> None:
    assert CompletionRequest(prompt="x").to_sampling_params(100).max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(100).max_tokens == 100
    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs).to_sampling_params(100).max_tokens == 100
    both = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=7)
    assert both.to_sampling_params(100).max_tokens == 7


def test_sampling_fields_and_defaults() -> None:
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "top_k": 5, "min_p": 0.1, "stop": "##", "seed": 3,
        "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "stop_token_ids": [7], "unknown": 1})
    p = req.to_sampling_params(10, {"temperature": 0.6, "top_k": 50})
    assert (p.top_k, p.temperature, p.min_p, p.stop, p.seed, p.logprobs) == (5, 0.6, 0.1, ["##"], 3, 2)
    assert p.ignore_eos and p.stop_token_ids == [7]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params(10).logprobs is None
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert plain.to_sampling_params(10).logprobs == 0


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),  # -1 (all) also needs logprobs: true
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ["", "x"]}, "stop"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_chat_cross_field_checks(body: dict[str, Any], param: str) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    with pytest.raises(ParamError) as e:
        req.check()
    assert e.value.param == param


def test_chat_message_parts_and_tool_arguments() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"}]})
    msgs = req.template_messages()
    assert msgs[0] == {"role": "user", "content": "a\nb"}
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[2]["tool_call_id"] == "1"


# --- stop strings and choice state ---------------------------------------------------------------


def test_find_stop() -> None:
    assert find_stop("hello world", 0, ["wor"], False) == (6, "wor")
    assert find_stop("hello world", 0, ["wor"], True) == (9, "wor")
    assert find_stop("hello world", 0, ["zz", "o", "l"], False) == (2, "l")  # earliest wins
    assert find_stop("abcabc", 4, ["abc"], False) == (3, "abc")  # only matches that reach new text
    assert find_stop("abcabc", 6, ["abc"], False) is None


def _state(stop: list[str], include: bool = False, min_tokens: int = 0) -> ChoiceState:
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=50)
    return ChoiceState(0, "r-0", [5], params, CharDetok(CharTokenizer(), True))


def _feed(state: ChoiceState, text: str, finish_last: str | None = None) -> list[str]:
    deltas = []
    for k, ch in enumerate(text):
        last = k == len(text) - 1 and finish_last is not None
        out = RequestOutput("r-0", [ord(ch)], None, None, last, finish_last if last else None, None, None, 1, 0, 0)
        deltas.append(state.feed(out).text)
        if state.finished:
            break
    return deltas


def test_stop_string_holds_back_and_truncates() -> None:
    s = _state(["END"])
    deltas = _feed(s, "abcENDxyz")
    assert "".join(deltas) == "abc" and s.text == "abc"
    assert (s.finish_reason, s.stop_reason) == ("stop", "END")
    assert deltas[:3] == ["", "", "a"]  # two characters held back: they could start "END"
    assert len(s.token_ids) == 6  # tokens of the stop string are still reported


def test_stop_string_kept_with_include() -> None:
    s = _state(["END"], include=True)
    assert "".join(_feed(s, "abcENDxyz")) == "abcEND"


def test_stop_string_ignored_before_min_tokens() -> None:
    s = _state(["b"], min_tokens=3)
    _feed(s, "abcb")
    assert s.text == "abc" and s.stop_reason == "b"


def test_held_back_text_flushed_at_length() -> None:
    s = _state(["XYZ"])
    assert "".join(_feed(s, "abcXY", finish_last="length")) == "abcXY"
    assert s.finish_reason == "length"


def test_stop_token_text_excluded_unless_included() -> None:
    for include, expect in ((False, "ab"), (True, "ab!")):
        s = _state([], include=include)
        _feed(s, "ab!", finish_last="stop")
        assert s.text == expect


# --- logprob shapes ------------------------------------------------------------------------------


def _ctx() -> ServingContext:
    info = ModelInfo(["tiny"], "/m", MAX_LEN, VOCAB)
    return ServingContext(EngineConfig(), FakeClient(), CharTokenizer(), info, Metrics("tiny"))  # type: ignore[arg-type]


def test_completion_logprobs_shape() -> None:
    lp = completion_logprobs(_ctx(), [ord("a"), ord("b")], [-0.1, float("-inf")],
                             [[[ord("a"), -0.1], [ord("c"), -2.0]], [[ord("c"), -1.0]]], text_offset=3)
    assert lp == {"text_offset": [3, 4], "token_logprobs": [-0.1, -9999.0], "tokens": ["a", "b"],
                  "top_logprobs": [{"a": -0.1, "c": -2.0}, {"c": -1.0, "b": -9999.0}]}
    assert completion_logprobs(_ctx(), [1], None, None, 0) is None
    assert completion_logprobs(_ctx(), [65], [-1.0], None, 0, as_ids=True)["tokens"] == ["token_id:65"]


def test_chat_logprobs_shape() -> None:
    lp = chat_logprobs(_ctx(), [ord("a")], [-0.25], [[[ord("c"), -3.0], [ord("a"), -0.25]]], 1)
    assert lp == {"content": [{"token": "a", "logprob": -0.25, "bytes": [97],
                               "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]}]}
    special = chat_logprobs(_ctx(), [EOS], [-1.0], None, 0)
    assert special["content"][0]["token"] == "<eos>" and special["content"][0]["top_logprobs"] == []


# --- HTTP: errors ------------------------------------------------------------------------------------


LIMITS = dict(max_prompts_per_request=8, max_prompt_tokens_per_request=100, max_request_body_bytes=64 * 1024)


@pytest.mark.parametrize("case", bad_input_cases(max_model_len=MAX_LEN, vocab_size=VOCAB, max_logprobs=5,
                                                 scale_out=True, max_prompts=8, max_prompt_tokens=100,
                                                 max_body_bytes=64 * 1024), ids=lambda c: c.description)
def test_bad_inputs(case: Any) -> None:
    http, _ = make_app(enable_scale_out=True, enable_trace_replay=True, **LIMITS)
    if isinstance(case.body, bytes):
        r = http.post(case.path, content=case.body, headers={"content-type": "application/json"})
    else:
        r = http.post(case.path, json=case.body)
    assert r.status_code == case.status, r.text
    if case.status != 200:
        err = r.json()["error"]
        assert err["param"] == case.param, err
        assert err["code"] == case.status and err["message"]
        assert err["type"] == {404: "NotFoundError", 413: TOO_LARGE}.get(case.status, "BadRequestError")


def test_context_length_message_is_vllms() -> None:
    http, _ = make_app()
    r = http.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested 70 tokens (60 in the "
        "messages, 10 in the completion). Please reduce the length of the messages or completion.")
    r = http.post("/v1/completions", json={"prompt": "x", "logprobs": 9})
    assert r.json()["error"]["message"] == "Requested sample logprobs of 9, which is greater than max allowed: 5"
    r = http.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert r.json()["error"]["message"] == "The model `nope` does not exist."


def test_api_key() -> None:
    http, _ = make_app(api_key="sekrit")
    r = http.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert http.get("/health").status_code == 200  # only /v1 is protected, like vLLM


def test_dead_engine_is_503_and_unknown_route_is_enveloped() -> None:
    http, client = make_app()
    client.dead_reason = "worker-0 died"
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert http.get("/health").status_code == 503
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_engine_error_non_stream_and_stream() -> None:
    http, client = make_app()
    client.fail_after = 2
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    assert r.status_code == 500 and r.json()["error"]["message"] == "worker exploded"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "worker exploded"


def test_an_engine_error_with_a_status_keeps_it() -> None:
    """The engine's typed error decides the HTTP status, not a match on its text: 503 for a failure the
    engine knows is temporary (paused, weights discarded by a level-2 sleep), whatever it says."""
    http, client = make_app()
    client.fail_after = 1
    client.failure = ErrorInfo("WeightsDiscarded", "the weights are not there yet", "worker-0", 503)
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    assert r.status_code == 503, r.text
    assert r.json()["error"] == {"message": "the weights are not there yet", "type": "ServiceUnavailableError",
                                 "param": None, "code": 503}
    client.failure = ErrorInfo("StepFailed", "Generation is paused. Please retry after it resumes.")
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    assert r.status_code == 500, r.text  # no status: a 500, even when the words look like a pause


def test_big_prompt_is_tokenized_off_the_loop_and_checked() -> None:
    http, _ = make_app()
    r = http.post("/v1/completions", json={"prompt": ["a" * 9000, "b"], "max_tokens": 1})
    assert r.status_code == 400 and "(9000 in the messages, 1 in the completion)" in r.json()["error"]["message"]


def test_non_stream_wait_is_cancelled_on_disconnect() -> None:
    from gateway.client_disconnect import ClientDisconnected, until_disconnected

    async def scenario() -> bool:
        gone = asyncio.Event()
        cancelled = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def work() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.05, gone.set)
        with pytest.raises(ClientDisconnected):
            await until_disconnected(receive, work())
        return cancelled.is_set()

    assert asyncio.run(scenario())
