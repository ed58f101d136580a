"""vLLM's tokenizer, render, prefix-cache and server-info routes: shapes against a fake engine (fast), then
the real engine for what only it can show (the prefix cache, the workers' dtype)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from bus.messages import CommandBody, ControlReply, PrefixCacheReset, ResetPrefixCache
from tests.server_helpers import start_server
from tests.test_gateway_protocol import FakeClient, make_app

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def test_tokenize_and_detokenize_shapes() -> None:
    http, _ = make_app()
    assert http.post("/tokenize", json={"prompt": "Hi"}).json() == \
        {"count": 2, "max_model_len": 64, "tokens": [72, 105], "token_strs": None}
    chat = http.post("/tokenize", json={"messages": CHAT["messages"], "return_token_strs": True}).json()
    assert chat["tokens"] == [ord(c) for c in "<user>Hi\n<assistant>"] and chat["token_strs"][0] == "<"
    no_gen = http.post("/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == [ord(c) for c in "<user>Hi\n"]
    assert http.post("/detokenize", json={"tokens": [1, 72, 105]}).json() == {"prompt": "<bos>Hi"}  # specials kept


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "Hi", "model": "nope"}, 404, "model"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"a": 1}}, 400,
     "mm_processor_kwargs"),
    ("/detokenize", {"tokens": [72, 1000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "Hi"}, 400, "tokens"),
    ("/detokenize", b"{not json", 400, None),
    ("/v1/chat/completions/render", {**CHAT, "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/chat/completions/render", {**CHAT, "return_token_offsets": True}, 400, "return_token_offsets"),
    ("/v1/chat/completions/render", {**CHAT, "model": "nope"}, 404, "model"),
    ("/v1/completions/render", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": "Hi", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs.regex"),
])
def test_bad_tokenizer_and_render_requests(path, body, status, param) -> None:
    http, _ = make_app(enable_scale_out=True)
    r = http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == status


def test_render_is_a_scale_out_endpoint() -> None:
    http, _ = make_app()
    for path, body in (("/v1/chat/completions/render", CHAT), ("/v1/completions/render", {"prompt": "Hi"})):
        r = http.post(path, json=body)
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"


def test_rendered_request_generates_what_the_chat_request_generates() -> None:
    http, client = make_app(enable_scale_out=True)
    r = http.post("/v1/chat/completions/render", json={**CHAT, "seed": 5, "logprobs": True, "top_logprobs": 2,
                                                        "cache_salt": "s1"})
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["request_id"].startswith("chatcmpl-") and g["output_mode"] == "tokens" and g["features"] is None
    assert g["token_ids"] == [ord(c) for c in "<user>Hi\n<assistant>"] and g["cache_salt"] == "s1"
    sp = g["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["logprobs"], sp["output_kind"]) == (3, 0.0, 5, 2, 2)
    assert g["parse_context"]["tool_choice"] == "none"
    out = http.post("/inference/v1/generate", json=g)
    assert out.status_code == 200, out.text
    chat = http.post("/v1/chat/completions", json={**CHAT, "seed": 5, "return_token_ids": True}).json()
    assert out.json()["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    assert client.submitted[-1][1] == client.submitted[-2][1]  # the same prompt reached the engine


def test_render_carries_the_logits_processors_and_priority_to_generate() -> None:
    http, client = make_app(enable_scale_out=True, scheduling_policy="priority")
    body = {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1.5}, "allowed_token_ids": [5, 72],
            "bad_words": ["x"], "priority": -2}
    g = http.post("/v1/completions/render", json=body).json()[0]
    sp = g["sampling_params"]
    assert (sp["logit_bias"], sp["allowed_token_ids"], sp["bad_words"], g["priority"]) == \
        ({"5": 1.5}, [5, 72], ["x"], -2)
    assert "priority" not in sp and "bad_words_token_ids" not in sp  # request-level / the engine's own
    assert http.post("/inference/v1/generate", json=g).status_code == 200
    direct = http.post("/v1/completions", json=body)
    assert direct.status_code == 200, direct.text
    assert client.submitted[-1][2] == client.submitted[-2][2]  # the same SamplingParams reached the engine
    assert client.submitted[-1][2].bad_words_token_ids == [[ord("x")]] and client.submitted[-1][2].priority == -2


def test_completion_render_gives_one_request_per_prompt() -> None:
    http, _ = make_app(enable_scale_out=True)
    r = http.post("/v1/completions/render", json={"prompt": ["Hi", "Yo"], "max_tokens": 2, "n": 2},
                  headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    assert [(g["request_id"], g["token_ids"], g["sampling_params"]["n"]) for g in r.json()] == \
        [("cmpl-abc-0", [72, 105], 2), ("cmpl-abc-1", [89, 111], 2)]


class ResetRecorder(FakeClient):
    """Records the control commands; the scheduler answers a reset with success."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[CommandBody] = []

    async def control(self, command: CommandBody, timeout_s: float = 0.0) -> ControlReply:
        self.commands.append(command)
        return ControlReply("x", True, 1, {"scheduler": PrefixCacheReset(True), "worker-0": None}, [])


@pytest.mark.unit
@pytest.mark.parametrize("params, body, running", [
    ({}, None, False),
    ({"reset_running_requests": "true"}, None, True),
    ({}, {"reset_running_requests": True}, True),  # SkyRL's call: honoured (vLLM drops it)
    ({}, {"reset_running_requests": False, "reset_external": True}, False),
    ({"reset_running_requests": "1"}, {"reset_running_requests": True}, True),  # the same both ways
    ({"reset_external": "true"}, {"reset_running_requests": True}, True),
    ({}, {"reset_running_requests": None}, False),
])
def test_reset_prefix_cache_options_from_query_or_body(params, body, running) -> None:
    client = ResetRecorder()
    http, _ = make_app(client, additional_config='{"rl_config": {"enabled": true}}')
    r = http.post("/reset_prefix_cache", params=params, json=body)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    assert client.commands == [ResetPrefixCache(running)]


@pytest.mark.unit
@pytest.mark.parametrize("params, body, param", [
    ({"reset_running_requests": "maybe"}, None, "reset_running_requests"),
    ({}, {"reset_running_requests": "true"}, "reset_running_requests"),  # the body's type is a JSON boolean
    ({}, {"reset_external": 1}, "reset_external"),
    ({"reset_running_requests": "false"}, {"reset_running_requests": True}, "reset_running_requests"),
    ({"reset_external": "true"}, {"reset_external": False}, "reset_external"),
    ({}, {"frobnicate": 1}, "frobnicate"),
    ({}, [True], None),
])
def test_reset_prefix_cache_refuses_bad_or_contradicting_options(params, body, param) -> None:
    client = ResetRecorder()
    http, _ = make_app(client, additional_config='{"rl_config": {"enabled": true}}')
    r = http.post("/reset_prefix_cache", params=params, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.commands == []  # nothing reached the engine


# --- the real engine -------------------------------------------------------------------------------

RL = '{"rl_config": {"enabled": true}}'


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    s = start_server(tmp_path_factory.mktemp("vllm-routes"), "--additional-config", RL, "--max-model-len", "1024",
                     "--weight-transfer-config", '{"backend": "nccl"}', "--enable-scale-out")
    yield s
    s.stop()


def _cached(url: str, body: dict) -> int:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_prefix_cache_as_vllm(server) -> None:
    url = server.url
    body = {"prompt": "A long shared prefix for caching. " * 10, "max_tokens": 2}
    _cached(url, body)
    assert _cached(url, body) > 0
    r = httpx.post(url + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    assert _cached(url, body) == 0
    # while a request holds KV the reset fails (the caller retries), unless it may preempt
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(httpx.post(url + "/v1/completions", timeout=280, json={
        "prompt": "Count: 1 2 3", "max_tokens": 60, "ignore_eos": True, "temperature": 0}).json()))
    t.start()
    _wait_running(url)
    assert httpx.post(url + "/reset_prefix_cache").json() == {"success": False}
    # SkyRL's call (the option in a JSON body) preempts the running request, as the query form does (both
    # forms, and their contradictions, are unit tests above)
    r = httpx.post(url + "/reset_prefix_cache", params={"reset_external": "true"},
                   json={"reset_running_requests": True})
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    t.join(280)
    # the preempted request was recomputed and finished whole
    assert got["choices"][0]["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 60
    for params, body_json, param in (({"reset_running_requests": "maybe"}, None, "reset_running_requests"),
                                     ({"reset_running_requests": "false"}, {"reset_running_requests": True},
                                      "reset_running_requests"),  # query and body disagree
                                     ({}, {"reset_running_requests": "yes"}, "reset_running_requests"),
                                     ({}, {"frobnicate": 1}, "frobnicate")):
        r = httpx.post(url + "/reset_prefix_cache", params=params, json=body_json)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # SkyRL sends the default in the body: the same as the query, accepted
    assert httpx.post(url + "/reset_prefix_cache", json={"reset_running_requests": False}).status_code == 200


def test_cache_salt_isolates_the_prefix_cache(server) -> None:
    """vLLM's cache_salt: a prefix cached under one salt is reused by that salt only."""
    url = server.url
    body = {"prompt": "A salted prefix that only its tenant may reuse. " * 8, "max_tokens": 1}
    _cached(url, {**body, "cache_salt": "tenant-a"})
    assert _cached(url, {**body, "cache_salt": "tenant-a"}) > 0
    assert _cached(url, {**body, "cache_salt": "tenant-b"}) == 0
    assert _cached(url, body) == 0  # nor an unsalted request
    assert _cached(url, body) > 0  # which caches its own
    chat = {"messages": [{"role": "user", "content": "Salted chat. " * 20}], "max_tokens": 1}
    for salt, hit in (("c", False), ("c", True), ("d", False)):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "cache_salt": salt}, timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is hit, (salt, r.json()["usage"])


def _wait_running(url: str) -> None:
    deadline = time.monotonic() + 30
    while metric_value(url, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)  # polling a condition with a deadline


def metric_value(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_server_info_has_vllm_config(server, smollm2_dir) -> None:
    info = httpx.get(server.url + "/server_info", params={"config_format": "json"}).json()
    vc = info["vllm_config"]
    assert vc["model_config"]["dtype"] == "torch.float32" and vc["model_config"]["max_model_len"] == 1024
    assert vc["model_config"]["model"] == str(smollm2_dir)
    assert vc["parallel_config"]["tensor_parallel_size"] == 1 and vc["parallel_config"]["data_parallel_size"] == 1
    assert vc["weight_transfer_config"] == {"backend": "nccl"}  # what TRL's init_communicator checks
    assert vc["cache_config"]["num_gpu_blocks"] > 0 and vc["device_config"]["device"] == "cpu"
    assert vc["cache_config"]["in_batch_prefix_sharing"] is True  # on with the prefix cache by default
    text = httpx.get(server.url + "/server_info").json()["vllm_config"]
    assert isinstance(text, str) and "dtype=torch.float32" in text and "max_seq_len=1024" in text
    assert httpx.get(server.url + "/server_info", params={"config_format": "yaml"}).status_code == 400
    assert httpx.get(server.url + "/get_world_size").json() == {"world_size": 1}
