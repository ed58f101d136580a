"""LoRA through `rollbus serve`: vLLM's load/unload routes and their errors, /v1/models, a request choosing an
adapter by `model` with logprobs equal to HF + PEFT, mixed batches bitwise equal to requests alone, an in-place
reload that gives later requests the new version (in weight_versions) and never a prefix-cache block of the
old one, and the refusals (no runtime env, unknown names, bad folders)."""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import httpx
import pytest
import torch

from tests.lora_helpers import make_adapter, peft_oracle
from tests.serve_process import start_server
from tests.tiny_models import make_tiny_checkpoint, random_prompt

pytest.importorskip("peft")
ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_http")
    base = make_tiny_checkpoint("qwen3", root / "base")
    a = make_adapter(base, root / "a", rank=4, seed=1)
    b = make_adapter(base, root / "b", rank=8, seed=2, targets=["q_proj", "o_proj", "up_proj"])
    a2 = make_adapter(base, root / "a2", rank=4, seed=3)
    server = start_server(root, str(base), "--tokens-only", "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--lora-modules", f"a={a}", "--block-size", "4",
                          "--additional-config", '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}',
                          env=ENV)
    yield server, base, root, {"a": a, "b": b, "a2": a2}
    server.stop()


def _gen(server, model: str, prompt: list[int], n: int = 6) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "return_weight_versions": True})
    assert r.status_code == 200, r.text
    return r.json()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_load_list_select_and_match_peft(setup):
    server, base, _, ad = setup
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(ad["b"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    cards = {m["id"]: m for m in models}
    assert cards["a"]["parent"] == cards["b"]["parent"] == models[0]["id"] and cards["b"]["root"] == str(ad["b"])
    prompt = random_prompt(7, 1000, 5)
    for name in ("a", "b"):
        out = _gen(server, name, prompt)
        assert out["model"] == name
        choice = out["choices"][0]
        toks, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        oracle = peft_oracle(base, ad[name])
        with torch.no_grad():
            ref = torch.log_softmax(oracle(torch.tensor([prompt + toks])).logits[0].float(), -1)
        for i, (t, lp) in enumerate(zip(toks, lps)):
            assert int(ref[len(prompt) - 1 + i].argmax()) == t
            assert abs(float(ref[len(prompt) - 1 + i, t]) - lp) < TOL
        assert choice["weight_versions"][0]["lora_name"] == name


def test_mixed_batch_is_bitwise_the_same_as_alone(setup):
    server, *_ = setup
    prompts = [random_prompt(9, 1000, s) for s in range(6)]
    base_name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    models = ["a", "b", "a", "b", base_name, "a"]
    alone = [_gen(server, m, p)["choices"][0] for m, p in zip(models, prompts)]
    with cf.ThreadPoolExecutor(6) as ex:
        mixed = list(ex.map(lambda mp: _gen(server, *mp)["choices"][0], zip(models, prompts)))
    for x, y in zip(alone, mixed):
        assert x["token_ids"] == y["token_ids"]
        assert x["logprobs"]["token_logprobs"] == y["logprobs"]["token_logprobs"]


def test_inplace_reload_is_a_new_version_and_misses_the_old_cache(setup):
    server, base, root, ad = setup
    live = root / "live"
    shutil.copytree(ad["a"], live)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(live)}).status_code == 200
    prompt = random_prompt(17, 1000, 9)
    first = _gen(server, "live", prompt)["choices"][0]
    assert first["weight_versions"][0]["lora_version"] == 1
    shutil.rmtree(live)
    shutil.copytree(ad["a2"], live)  # the trainer writes new weights to the same folder
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(live), "load_inplace": True})
    assert r.status_code == 200, r.text
    second = _gen(server, "live", prompt)
    assert second["usage"].get("prompt_tokens_details") in (None, {"cached_tokens": 0}) or \
        second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["weight_versions"][0]["lora_version"] == 2
    oracle = peft_oracle(base, ad["a2"])
    toks = second["choices"][0]["token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(oracle(torch.tensor([prompt + toks])).logits[0].float(), -1)
    lp = second["choices"][0]["logprobs"]["token_logprobs"]
    assert abs(float(ref[len(prompt) - 1, toks[0]]) - lp[0]) < TOL


def test_refusals(setup, tmp_path):
    server, base, root, ad = setup
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(ad["a"])})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    big = make_adapter(base, tmp_path / "big", rank=16)
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Loading lora big failed: LoRA rank 16 is greater than max_lora_rank 8."
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "nope")})
    assert r.status_code == 404 and r.json()["error"]["message"] == \
        f"Loading lora gone failed: No adapter found for {tmp_path / 'nope'}"
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `nope` does not exist."
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).text == \
        "Success: LoRA adapter 'b' removed successfully."
    assert httpx.post(f"{server.url}/v1/completions", json={"model": "b", "prompt": [1], "max_tokens": 1}
                      ).status_code == 404
    doomed = root / "doomed"
    shutil.copytree(ad["b"], doomed)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "doomed", "lora_path": str(doomed)}).status_code == 200
    shutil.rmtree(doomed)  # gone before any worker read it: that request fails alone, naming the adapter
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "doomed", "prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 400 and "doomed" in r.json()["error"]["message"], r.text
    assert _gen(server, "a", [1, 2, 3], 2)["model"] == "a"  # still serving
