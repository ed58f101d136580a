"""The whole engine as users run it: `rollbus serve` (every process, real sockets) driven by the
official OpenAI client, checked against HF transformers on the same weights."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from tests.server_helpers import metric, start_server

pytestmark = pytest.mark.timeout(600)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    s = start_server(tmp_path_factory.mktemp("serve"), "--max-model-len", "2048", "--max-num-seqs", "64")
    yield s
    assert s.stop() == 0, s.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def hf_greedy_with_logprobs(hf, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        full = out[0].tolist()
        logits = hf(torch.tensor([full])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    gen = full[len(prompt_ids):]
    return gen, [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(gen)]


def test_chat_answers_like_the_model(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of Japan?"}])
    assert "Tokyo" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10


def test_greedy_tokens_and_logprobs_equal_hf(client, hf_model, smollm2_dir):
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = ["The history of the Roman empire", "def fibonacci(n):", "Once upon a time, in a small village"]
    for text in prompts:
        ids = tok.encode(text)
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        ours = r.choices[0].logprobs
        want_ids, want_lp = hf_greedy_with_logprobs(hf_model, ids, 16)
        got_ids = [int(t.split(":")[1]) for t in ours.tokens] if ours.tokens[0].startswith("token_id:") \
            else tok.encode(r.choices[0].text)
        assert got_ids == want_ids, text
        assert max(abs(a - b) for a, b in zip(ours.token_logprobs, want_lp)) < 1e-4


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="List three colors:", max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=12, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    parts = list(chat)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens > 0


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(client):
    kw = dict(model=MODEL, prompt="Write a word:", max_tokens=12, temperature=1.0, n=4, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert ta == tb
    assert len(set(ta)) > 1
    assert a.usage.completion_tokens == 4 * 12


def test_several_prompts_and_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=20, temperature=0,
                                  stop=[","])
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop" and "," not in c.text


def test_concurrent_requests_match_sequential_ones(client):
    """Continuous batching: requests that share steps get the same greedy tokens as alone."""
    prompts = [f"Count from {i}:" for i in range(12)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts[:3]]
    results: dict[int, str] = {}

    def go(i):
        results[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10 + i,
                                               temperature=0).choices[0].text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == len(prompts)
    for i in range(3):
        assert results[i][: len(alone[i])] == alone[i] or results[i].startswith(alone[i][:10])


def test_prefix_cache_hits_on_a_repeated_prompt(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    cached = (b.usage.prompt_tokens_details.cached_tokens if b.usage.prompt_tokens_details else 0)
    assert cached >= 64


def test_the_choices_of_one_request_compute_their_shared_prompt_once(server, client):
    """--in-batch-prefix-sharing (on by default): the four choices of an n=4 request that arrive while a step
    computes are planned together; one computes the prompt's full blocks, the other three wait one step and
    reuse them from the prefix cache. Without it all four compute the whole prompt (0 hits; checked by hand
    with --no-in-batch-prefix-sharing). A stream keeps the engine stepping so the choices arrive mid-step."""
    prompt = list(range(2000, 2070))  # 70 tokens: 4 full blocks of 16 before its last token
    busy = {"model": MODEL, "prompt": list(range(3000, 3010)), "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as h, h.stream("POST", server.url + "/v1/completions", json=busy) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is decoding
        before = metric(server, "vllm:prefix_cache_hits_total")
        r = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=6, temperature=0)
        hits = metric(server, "vllm:prefix_cache_hits_total") - before
    assert hits == 3 * 64
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert [c.text for c in r.choices] == [alone.choices[0].text] * 4


def test_client_disconnect_aborts_the_request(server):
    before = metric(server, "vllm:num_requests_running")
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1500,
                            "ignore_eos": True, "stream": True}) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i > 3:
                    break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(server, "vllm:num_requests_running") > before:
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == before


def test_metrics_and_models(server, client):
    models = client.models.list()
    assert models.data[0].id == MODEL
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in text
    assert metric(server, "vllm:generation_tokens_total") > 0
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()
