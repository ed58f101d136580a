"""POST /inference/v1/generate on a real --tokens-only server whose model folder has no tokenizer at all
(so none can be loaded): greedy tokens equal HF's, SSE streaming, abort mid-stream, text refused."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from tests.server_helpers import start_server
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    assert not (folder / "tokenizer.json").exists()
    s = start_server(tmp_path_factory.mktemp("serve"), str(folder), "--tokens-only", "--max-model-len", "256")
    yield s, folder
    s.stop()


def test_no_tokenizer_is_loaded_and_greedy_matches_hf(server):
    from transformers import AutoModelForCausalLM

    s, folder = server
    assert "gateway.tokens_only" in s.log()
    prompt = [3, 14, 15, 92, 65, 35]
    r = httpx.post(s.url + "/inference/v1/generate", timeout=60, json={
        "token_ids": prompt, "request_id": "g1", "return_token_ids": True,
        "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 1, "prompt_logprobs": 0}})
    body = r.json()
    assert r.status_code == 200, body
    assert body["request_id"] == "generate-tokens-g1" and body["prompt_token_ids"] == prompt
    c = body["choices"][0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert c["token_ids"] == want and c["finish_reason"] == "length"
    assert all(e["rank"] == 1 for e in c["logprobs"]["content"])  # greedy
    assert body["prompt_logprobs"][0] is None and body["prompt_logprobs"][1][str(prompt[1])]["decoded_token"] is None
    assert c["routed_experts"] is None and c["weight_versions"][0]["end"] == 8


def test_stream_and_abort_mid_stream(server):
    s, _ = server
    lines: list[str] = []

    def stream():
        with httpx.stream("POST", s.url + "/inference/v1/generate", timeout=60, json={
                "token_ids": [1, 2, 3], "request_id": "long", "stream": True,
                "sampling_params": {"max_tokens": 200, "ignore_eos": True, "logprobs": 0}}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while len(lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = httpx.post(s.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-long"]})
    assert r.status_code == 200 and r.content == b""
    t.join(30)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "abort" and last["weight_versions"] is not None
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) < 200
    # the legacy tokens-only route exists too, and the engine keeps serving
    assert httpx.post(s.url + "/abort_requests", json={"request_ids": ["nothing"]}).status_code == 200
    ok = httpx.post(s.url + "/inference/v1/generate", json={"token_ids": [4], "sampling_params": {"max_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_text_is_refused_clearly(server):
    s, _ = server
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(s.url + "/inference/v1/generate", json={"token_ids": [4], "sampling_params": {"stop": ["."]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop"
    r = httpx.post(s.url + "/v1/completions", json={"prompt": [4, 5], "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
