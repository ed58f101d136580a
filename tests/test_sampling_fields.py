"""vLLM's request-level sampling fields RL uses, through a real server: logit_bias, allowed_token_ids and
bad_words on the OpenAI routes and /inference/v1/generate, `priority` under --scheduling-policy priority, and
--return-sampling-mask on generate (a tiny random model with SmolLM2's tokenizer: the fields act on whatever
the model prefers)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer

HELLO, WORLD = 33662, 905  # SmolLM2's " hello" and " world"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("sampling-fields")
    folder = tiny_model_with_tokenizer("llama", tmp / "llama", smollm2_dir, vocab_size=49152)
    s = start_server(tmp, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--max-num-seqs", "1", "--scheduling-policy", "priority", "--enable-scale-out",
                     "--return-sampling-mask")
    yield s
    s.stop()


def _completion(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Say hello", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_allowed_token_ids_and_bad_words_on_the_openai_routes(server, smollm2_dir) -> None:  # noqa: F811
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tok.encode(" hello").ids == [HELLO] and tok.encode(" world").ids == [WORLD]
    # a +100 bias makes " hello" the argmax at every position; raw logprobs (the default mode) ignore it
    biased = _completion(server, max_tokens=4, temperature=0, logit_bias={str(HELLO): 100}, logprobs=1,
                         return_token_ids=True)
    assert biased["token_ids"] == [HELLO] * 4 and biased["text"] == " hello" * 4
    assert all(lp < -1.0 for lp in biased["logprobs"]["token_logprobs"])  # a random model: ~log(1/49152)
    # sampled at temperature 1 from two allowed ids only
    allowed = _completion(server, max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=[HELLO, WORLD],
                          return_token_ids=True)
    assert set(allowed["token_ids"]) <= {HELLO, WORLD}
    # bad_words wins over the bias: "hello" is banned ("hello" and " hello" both), " world" is next best
    banned = _completion(server, max_tokens=3, temperature=0, logit_bias={str(HELLO): 100, str(WORLD): 50},
                         bad_words=["hello"], return_token_ids=True)
    assert banned["token_ids"] == [WORLD] * 3
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "logit_bias": {str(WORLD): 100}, "return_token_ids": True})
    assert chat.status_code == 200 and chat.json()["choices"][0]["token_ids"] == [WORLD] * 3, chat.text


def test_the_fields_on_generate(server) -> None:
    r = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 1,
                                                    "allowed_token_ids": [HELLO, WORLD, 5],
                                                    "logit_bias": {"5": -100}, "logprobs": 0}})
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["token_ids"]) <= {HELLO, WORLD}
    bad = httpx.post(server.url + "/inference/v1/generate", timeout=60, json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logit_bias": {"49152": 1}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.logit_bias", bad.text


def test_sampling_mask_on_generate_whole_and_streamed(server) -> None:
    """Per generated token the ids the sampler could draw: top_k 5 keeps 5, the sampled token is in its row,
    allowed_token_ids narrow it further, and the stream's rows are the whole answer's."""
    sp = {"max_tokens": 6, "temperature": 1.0, "seed": 4, "top_k": 5, "logprobs": 0}
    body = {"token_ids": [1, 2, 3], "sampling_params": sp}
    r = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    mask = choice["sampling_mask"]
    assert len(mask) == len(choice["token_ids"]) == 6
    for tok, row in zip(choice["token_ids"], mask):
        assert len(row) == 5 and tok in row and row == sorted(row)
    rows = []
    with httpx.stream("POST", server.url + "/inference/v1/generate", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    rows += c["sampling_mask"] or []
    assert rows == mask
    narrow = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": [1, 2, 3], "sampling_params": {**sp, "allowed_token_ids": [HELLO, WORLD]}}).json()["choices"][0]
    assert all(set(row) == {HELLO, WORLD} for row in narrow["sampling_mask"])
    # a token nothing filtered lists the whole vocabulary (vLLM's meaning)
    plain = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "seed": 1}}).json()["choices"][0]
    assert len(plain["sampling_mask"][0]) == 49152


def test_priority_admits_the_lowest_value_first(server) -> None:
    """One sequence at a time (--max-num-seqs 1): while a long request runs, a new rollout (priority 5) and a
    resumed partial one (priority -1) wait; the resumed one is admitted first although it came second."""
    done: dict[str, float] = {}

    def run(name: str, priority: int, max_tokens: int) -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": f"{name} rollout", "max_tokens": max_tokens, "ignore_eos": True,
            "priority": priority})
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    threads = [threading.Thread(target=run, args=("long", 0, 240))]  # outlasts the two waits on a fast host
    threads[0].start()
    _wait_for(server, "vllm:num_requests_running", 1)
    for name, priority in (("new", 5), ("resumed", -1)):
        threads.append(threading.Thread(target=run, args=(name, priority, 4)))
        threads[-1].start()
        _wait_for(server, "vllm:num_requests_waiting", len(threads) - 1)
    for t in threads:
        t.join(300)
    assert done["long"] < done["resumed"] < done["new"], done


def _wait_for(server, name: str, at_least: float) -> None:
    deadline = time.monotonic() + 60
    while metric(server, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.02)  # polling a condition with a deadline
