"""--kv-cache-dtype bfloat16 / float16 under an fp32 model, through the whole engine (real processes, a tiny
random checkpoint): the cache really is 16 bits (twice the blocks in the same bytes, reported), prompt and
sampled logprobs stay within a 16-bit rounding of HF's fp32 numbers and differ from them by more than fp32
noise (the option is not inert), a rollout's own logprobs equal a teacher-forced pass over the same tokens
(both read the same rounded cache), and sleep releases the cache and wake gives it back. Bad values are refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.config import parse_config
from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from workers.kv_cache import KVCache

pytestmark = pytest.mark.timeout(600)
BUDGET = 8 << 20
FLAGS = ("--block-size", "4", "--max-num-batched-tokens", "16", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(BUDGET), "--enable-sleep-mode", "--max-logprobs", "5")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):  # noqa: F811
    return tiny_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("kvd"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def server(request, folder, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp(f"kvd-{request.param}"), str(folder), *FLAGS,
                     "--kv-cache-dtype", request.param, "--additional-config", '{"rl_config": {"enabled": true}}')
    yield request.param, s
    s.stop()


def post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_the_cache_is_16_bits_and_reported(server, hf) -> None:
    kv, s = server
    info = httpx.get(s.url + "/server_info", timeout=30).json()
    (w,) = info["workers"].values()
    assert (w["dtype"], w["kv_cache_dtype"]) == ("float32", kv)
    cfg = hf.config
    per = KVCache.bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, getattr(torch, kv))
    fp32 = KVCache.bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4, torch.float32)
    assert per * 2 == fp32 and w["num_blocks"] == BUDGET // per == 2 * (BUDGET // fp32)
    assert w["kv_cache_bytes"] == w["num_blocks"] * per
    vllm = httpx.get(s.url + "/server_info", params={"config_format": "json"}, timeout=30).json()
    assert vllm["vllm_config"]["cache_config"]["cache_dtype"] == kv


def test_logprobs_are_within_a_16_bit_rounding_of_hf_and_a_rollout_matches_teacher_forcing(server, hf) -> None:
    _, s = server
    vocab = hf.config.vocab_size
    prompt = [(31 * j + 7) % vocab for j in range(37)]  # longer than a prefill chunk: later chunks read the cache
    comp = post(s.url, {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                        "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": True})["choices"][0]
    out = comp["token_ids"]
    ref = hf_logprobs(hf, prompt + out)
    prompt_diff = max(abs(comp["prompt_logprobs"][i][str(prompt[i])]["logprob"] - ref[i - 1, prompt[i]].item())
                      for i in range(1, len(prompt)))
    sampled = comp["logprobs"]["token_logprobs"]
    sampled_diff = max(abs(lp - ref[len(prompt) - 1 + i, t].item()) for i, (t, lp) in enumerate(zip(out, sampled)))
    # fp32 KV agrees with HF to ~1e-6 (tests/test_logprobs_oracle.py: 1e-4); 16-bit keys and values move the
    # numbers by more than that, and by no more than a 16-bit rounding would
    assert 1e-5 < max(prompt_diff, sampled_diff) < 3e-2, (prompt_diff, sampled_diff)
    # a teacher-forced pass over the rollout's tokens (prefill, chunked) reads the same rounded keys and values
    # as the decode steps did: the rollout's logprobs are the trainer-visible ones
    forced = post(s.url, {"prompt": prompt + out, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0})
    pl = forced["choices"][0]["prompt_logprobs"]
    worst = max(abs(pl[len(prompt) + i][str(t)]["logprob"] - lp) for i, (t, lp) in enumerate(zip(out, sampled)))
    assert worst < 1e-4, worst


def test_sleep_releases_the_16_bit_cache_and_wake_gives_it_back(server) -> None:
    kv, s = server
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    before = post(s.url, body)["choices"][0]
    (w,) = httpx.get(s.url + "/server_info", timeout=30).json()["workers"].values()
    r = httpx.post(s.url + "/sleep", params={"level": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["released_bytes"] >= 0.99 * w["kv_cache_bytes"], r.text
    assert httpx.post(s.url + "/wake_up", timeout=60).json()["status"] == "awake"
    (w,) = httpx.get(s.url + "/server_info", timeout=30).json()["workers"].values()
    assert w["kv_cache_dtype"] == kv
    assert post(s.url, body)["choices"][0] == before  # text and logprobs, bit for bit


@pytest.mark.unit
@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "int8_per_token_head", "float32"])
def test_other_cache_dtypes_are_refused_naming_the_flag(value) -> None:
    with pytest.raises(SystemExit) as e:
        parse_config(["--kv-cache-dtype", value])
    assert isinstance(e.value.code, str)
    assert f"--kv-cache-dtype {value}: not supported here" in e.value.code
    assert "accepted: auto, bfloat16, float16" in e.value.code
    assert parse_config(["--kv-cache-dtype", "BFloat16"]).cache.kv_cache_dtype == "bfloat16"
