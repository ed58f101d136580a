"""Every supported architecture, MoE included, through the whole engine (tiny random checkpoints): greedy
tokens and logprobs equal HF transformers' on the same weights, in fp32, with requests batched together."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tests.server_helpers import start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "qwen2_moe"])
def test_engine_matches_hf(arch, tmp_path, smollm2_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_with_tokenizer(arch, tmp_path / arch, smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[(13 * i + 5 * j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    # block size 4 and a small token budget: prefills are chunked and span several blocks
    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256")
    try:
        got: dict[int, dict] = {}

        def go(i):
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "model": str(folder), "prompt": prompts[i], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
            assert r.status_code == 200, r.text
            got[i] = r.json()["choices"][0]["logprobs"]

        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        s.stop()
    for i, p in enumerate(prompts):
        ids = [int(t.removeprefix("token_id:")) for t in got[i]["tokens"]]
        with torch.no_grad():
            full = torch.tensor([p + ids])
            lp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        want = lp[len(p) - 1:-1].argmax(-1).tolist()
        assert ids == want, f"{arch} prompt {i}: greedy tokens differ from HF"
        want_lp = [lp[len(p) - 1 + k, t].item() for k, t in enumerate(ids)]
        assert max(abs(a - b) for a, b in zip(got[i]["token_logprobs"], want_lp)) < 1e-4
