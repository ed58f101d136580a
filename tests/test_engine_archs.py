"""Every supported architecture, MoE included, through the whole engine (tiny random checkpoints): greedy
tokens and logprobs equal HF transformers' on the same weights, in fp32, with requests batched together."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from tests.server_helpers import start_server, tiny_model_with_tokenizer
from tests.tiny_models import perturb

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
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


@pytest.mark.parametrize("arch", ["mistral", "qwen2_moe", "glm4_moe", "deepseek_v3",
                                  pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_new_archs_served_equal_hf_with_prompt_logprobs_routes_and_a_prefix_hit(arch, tmp_path, smollm2_dir):
    """Issue 34's archs through `rollbus serve`: a sliding window shorter than the prompts (Mistral; Qwen2-MoE's
    on its first layer only, so its blocks are the window group's own, engine.window_blocks), a grouped
    sigmoid router with shared experts (GLM-4.5), multi-head latent attention over its one-plane cache with
    YaRN and that router (DeepSeek-V3), attention sinks with alternating windows and the clamped-SwiGLU experts
    (gpt-oss). 4 concurrent requests of 32 greedy tokens: tokens equal HF's, every sampled and prompt logprob
    within 1e-4, routed experts HF's at every position and MoE layer; then the longest prompt again, alone and
    served from the prefix cache, gives the same bits (the server runs batch invariant)."""
    import base64
    import io

    import numpy as np
    from transformers import AutoModelForCausalLM

    from tests.test_arch_oracle import hf_routes

    folder = tiny_model_with_tokenizer(arch, tmp_path / arch, smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[(17 * i + 3 * j * j) % 900 + 3 for j in range(6 + 7 * i)] for i in range(4)]
    from bench.batch_invariance import INVARIANT_CONFIG

    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256", "--enable-return-routed-experts",
                     "--additional-config", INVARIANT_CONFIG)
    body = {"model": str(folder), "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    try:
        got: dict[int, dict] = {}

        def go(i):
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": prompts[i]})
            assert r.status_code == 200, r.text
            got[i] = r.json()["choices"][0]

        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        again = httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": prompts[3]}).json()
    finally:
        s.stop()
    assert again["choices"][0]["logprobs"] == got[3]["logprobs"], "a prefix-cache hit changed the output"
    for i, p in enumerate(prompts):
        c = got[i]
        ids = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        lp, routes = hf_routes(hf, p + ids)
        assert ids == lp[len(p) - 1:-1].argmax(-1).tolist(), f"{arch} prompt {i}: greedy tokens differ from HF"
        want = [lp[k - 1, t].item() for k, t in enumerate(p + ids) if k]
        prompt_lp = [next(iter(d.values()))["logprob"] for d in c["prompt_logprobs"][1:]]
        served = prompt_lp + c["logprobs"]["token_logprobs"]
        assert len(served) == len(want) and max(abs(a - b) for a, b in zip(served, want)) < 1e-4
        if routes is None:
            assert c.get("routed_experts") is None
            continue
        rows = np.sort(np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False), axis=-1)
        assert np.array_equal(rows, routes[:-1].numpy()), f"{arch} prompt {i}: routed experts differ from HF"


@pytest.mark.parametrize("arch, backend", [("deepseek_v3", "ipc"),
                                           pytest.param("deepseek_v3", "gloo", marks=pytest.mark.slow),
                                           pytest.param("gpt_oss", "ipc", marks=pytest.mark.slow)])
def test_weight_update_by_hf_names_across_sleep_and_wake(arch, backend, tmp_path, smollm2_dir):
    """DeepSeek-V3 (and gpt-oss: sinks, biased transposed experts) served with sleep mode and weight sync: the
    trainer (HF transformers) moves every parameter
    and the colocated recipe runs (sleep level 2: weights and the latent KV cache discarded; wake the weights;
    the update by HF's in-memory names, packed: MLA's q_a / q_b / kv_a / kv_b projections, whose kv_b views the
    absorbed attention reads, the stacked experts, the fp32 routers and their correction biases; wake the
    cache). The engine then equals the trainer (greedy tokens, logprobs within 1e-4), /weight_checker matches
    it bitwise (the stacked experts under their in-memory names too), and a level-1 sleep and wake gives the
    same bits again."""
    import json

    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient, weight_checksums

    folder = tiny_model_with_tokenizer(arch, tmp_path / arch, smollm2_dir)
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [5, 17, 99, 250, 31, 8, 77, 401, 12]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    cfg = json.dumps({"backend": backend, "timeout_s": 20})
    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-model-len", "128", "--enable-sleep-mode",
                     "--additional-config", '{"rl_config": {"enabled": true}}', "--weight-transfer-config", cfg)

    def served() -> dict:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    def post(path: str) -> httpx.Response:
        r = httpx.post(s.url + path, timeout=120)
        assert r.status_code == 200, r.text
        return r

    try:
        before = served()
        perturb(trainer)
        post("/sleep?level=2")
        post("/wake_up?tags=weights")
        with WeightSyncClient(s.url, backend="ipc" if backend == "ipc" else "nccl", packed=True,
                              packed_buffer_size_bytes=96 << 10) as client:
            # the state dict: the routers' e_score_correction_bias are buffers in HF (level 2 discarded them too)
            client.send_weights(trainer.state_dict().items(), version="v1", pause=None)
        assert post("/wake_up?tags=kv_cache").json()["status"] == "awake"
        after = served()
        sums = weight_checksums(trainer.state_dict().items())
        check = httpx.post(s.url + "/weight_checker", json={"action": "compare", "baseline": sums}).json()
        post("/sleep?level=1")
        post("/wake_up")
        again = served()
    finally:
        s.stop()
    assert check == {"match": True, "mismatches": []}
    assert again == after and after["tokens"] != before["tokens"]
    ids = [int(t.removeprefix("token_id:")) for t in after["tokens"]]
    with torch.no_grad():
        lp = torch.log_softmax(trainer(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
    assert ids == lp[len(prompt) - 1:-1].argmax(-1).tolist(), "greedy tokens differ from the trainer's"
    want = [lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(after["token_logprobs"], want)) < 1e-4


# (arch, tokens per sequence, flags): Mistral's every layer sees 7 keys, the 64 blocks are one pool; Gemma 3 mixes
# sliding layers (6 keys) with a full one: the sliding layers' own pool holds each of the 4 sequences' windows
# (24 blocks), so the full layer gets the rest of the 64 blocks' bytes (144 blocks)
# (workers.kv_cache.split_window_pool; gpt-oss: 2 layers, 104 + 24)
WINDOW_CASES = [("mistral", 200, ()), ("gemma3", 130, ("--max-num-seqs", "4")),
                pytest.param("gpt_oss", 100, ("--max-num-seqs", "4"), marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch, total, flags", WINDOW_CASES)
def test_window_frees_blocks_equal_hf_and_a_prefix_hit_stays_correct(arch, total, flags, tmp_path, smollm2_dir):
    """The scheduler gives back the blocks behind the sliding window (of every layer, or of the sliding layers'
    own block table where layers mix windows), so four sequences run at once in a KV cache of 64 blocks of 4
    tokens (one 256-token sequence's worth with one table for full attention) without a preemption; tokens equal
    HF's, logprobs within 1e-4. A prompt sent twice hits the prefix cache (blocks released but not rewritten)
    and still equals HF."""
    from transformers import AutoModelForCausalLM

    from tests.server_helpers import metric

    folder = tiny_model_with_tokenizer(arch, tmp_path / arch, smollm2_dir)
    # the oracle in fp64 where HF can (the dense archs; gpt-oss's grouped expert GEMM takes no fp64): the same on
    # every host, where HF's fp32 SDPA and GEMMs pick their kernels by CPU
    hf_dtype = torch.float32 if arch == "gpt_oss" else torch.float64
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=hf_dtype).eval()
    prompts = [[(11 * i + 7 * j * j) % 900 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256", "--num-gpu-blocks-override", "64", *flags)
    body = {"model": str(folder), "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    got: dict[int, dict] = {}
    try:
        def go(i, max_tokens):
            r = httpx.post(s.url + "/v1/completions", timeout=120,
                           json={**body, "prompt": prompts[i], "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
            got[i] = r.json()["choices"][0]["logprobs"]

        ts = [threading.Thread(target=go, args=(i, total - len(prompts[i]))) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        prompts += [prompts[0][:14] + [5, 6, 7]] * 2  # a new prompt, then again: its first 4 blocks hit
        go(4, 8)
        go(5, 8)
        deadline = time.monotonic() + 30  # the scheduler's counters reach /metrics a moment after the replies
        while metric(s, "rollbus_engine_generation_tokens_total") < 4 * total - sum(map(len, prompts[:4])) + 16:
            assert time.monotonic() < deadline, "the scheduler's counters did not reach /metrics"
            time.sleep(0.05)
        assert metric(s, "rollbus_prefix_cache_hit_blocks_total") >= 4
        assert metric(s, "vllm:num_preemptions_total") == 0
    finally:
        s.stop()
    for i, p in enumerate(prompts):
        ids = [int(t.removeprefix("token_id:")) for t in got[i]["tokens"]]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + ids])).logits[0].float(), dim=-1)
        assert ids == lp[len(p) - 1:-1].argmax(-1).tolist(), f"prompt {i}: greedy tokens differ from HF"
        want = [lp[len(p) - 1 + k, t].item() for k, t in enumerate(ids)]
        errs = [abs(a - b) for a, b in zip(got[i]["token_logprobs"], want)]
        worst = max(range(len(errs)), key=errs.__getitem__)
        assert errs[worst] < 1e-4, (f"prompt {i} ({len(p)} tokens): generated token {worst} off by {errs[worst]:.2e}; "
                                    f"errors above 1e-4 at {[k for k, e in enumerate(errs) if e >= 1e-4]}")
