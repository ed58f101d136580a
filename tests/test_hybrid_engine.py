"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, MoE with a shared expert) through `rollbus serve`: the
recurrent-state pool beside the KV cache, handed out per running sequence by the scheduler, carried across
prefill chunks, discarded and re-created with the cache by sleep, and the model's weights updated by HF names.

One server run (tiny random checkpoint, fp32): 4 concurrent requests of 32 greedy tokens with prompts chunked
over several steps (a 16-token budget) equal HF (tokens, every sampled and prompt logprob within 1e-4, routed
experts at every position and MoE layer); the longest prompt again, without prompt logprobs, resumes from the
recurrent-state checkpoint of its last full block (a prefix hit, engine.state_checkpoints) and equals HF too;
then the colocated RL recipe (sleep level 2, wake
the weights, an update by HF names over ipc, wake the cache) serves what the trainer computes and
/weight_checker matches it; a level-1 sleep and wake gives the same bits again."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import pytest
import torch

from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.tiny_models import perturb

pytestmark = pytest.mark.timeout(300)


def _check_against_hf(hf, prompt: list[int], choice: dict) -> None:
    from tests.test_arch_oracle import hf_routes

    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    lp, routes = hf_routes(hf, prompt + ids)
    assert ids == lp[len(prompt) - 1:-1].argmax(-1).tolist(), "greedy tokens differ from HF"
    want = [lp[k - 1, t].item() for k, t in enumerate(prompt + ids) if k]
    served = [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
    served += choice["logprobs"]["token_logprobs"]
    assert len(served) == len(want) and max(abs(a - b) for a, b in zip(served, want)) < 1e-4
    rows = np.sort(np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False), axis=-1)
    assert np.array_equal(rows, routes[:-1].numpy()), "routed experts differ from HF's"


def test_qwen3_next_served_equals_hf_and_survives_sleep_and_a_weight_update(tmp_path, smollm2_dir):
    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient, weight_checksums

    folder = tiny_model_with_tokenizer("qwen3_next", tmp_path / "qwen3_next", smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[(17 * i + 3 * j * j) % 900 + 3 for j in range(6 + 11 * i)] for i in range(4)]
    body = {"model": str(folder), "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    cfg = json.dumps({"backend": "ipc", "timeout_s": 20})
    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256", "--max-num-seqs", "8", "--enable-return-routed-experts",
                     "--enable-sleep-mode", "--additional-config", '{"rl_config": {"enabled": true}}',
                     "--weight-transfer-config", cfg, env={"VLLM_SERVER_DEV_MODE": "1"})

    def served(prompt: list[int], **fields) -> dict:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": prompt, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    def post(path: str) -> httpx.Response:
        r = httpx.post(s.url + path, timeout=120)
        assert r.status_code == 200, r.text
        return r

    try:
        got: dict[int, dict] = {}
        ts = [threading.Thread(target=lambda i=i: got.__setitem__(i, served(prompts[i]))) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        again = served(prompts[3], prompt_logprobs=None)  # a request asking for prompt logprobs never hits
        hits = metric(s, "vllm:prefix_cache_hits_total")
        queries = metric(s, "vllm:prefix_cache_queries_total")
        # /server_info says what the scheduler does (on: the workers have room for state checkpoints)
        info = httpx.get(s.url + "/server_info?config_format=json", timeout=10).json()
        cache_config = info["vllm_config"]["cache_config"]
        perturb(hf)
        post("/sleep?level=2")
        post("/wake_up?tags=weights")
        with WeightSyncClient(s.url, backend="ipc", packed=True, packed_buffer_size_bytes=96 << 10) as client:
            client.send_weights(hf.state_dict().items(), version="v1", pause=None)
        assert post("/wake_up?tags=kv_cache").json()["status"] == "awake"
        after = served(prompts[2])
        check = httpx.post(s.url + "/weight_checker", json={"action": "compare",
                                                            "baseline": weight_checksums(hf.state_dict().items())})
        post("/sleep?level=1")
        post("/wake_up")
        again_after = served(prompts[2])
    finally:
        s.stop()
    assert queries > 0 and hits == 36, "the repeated prompt resumes at its last full block's checkpoint"
    assert cache_config["enable_prefix_caching"] is True, cache_config
    assert cache_config["in_batch_prefix_sharing"] is False, cache_config  # a hybrid's hits need checkpoints
    assert again["logprobs"]["tokens"] == got[3]["logprobs"]["tokens"]
    assert check.json() == {"match": True, "mismatches": []}
    assert again_after["logprobs"] == after["logprobs"]
    _check_against_hf(hf, prompts[2], after)  # hf holds the updated weights now; the first answers: the originals
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        _check_against_hf(fresh, p, got[i])
    from tests.test_arch_oracle import hf_routes

    ids = [int(t.removeprefix("token_id:")) for t in again["logprobs"]["tokens"]]
    lp, _ = hf_routes(fresh, prompts[3] + ids)
    want = [lp[len(prompts[3]) - 1 + k, t].item() for k, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(again["logprobs"]["token_logprobs"], want)) < 1e-4


@pytest.mark.slow
def test_qwen3_next_with_tp2_serves_what_tp1_does_and_updates_every_shard(tmp_path):
    """-tp 2 splits the linear-attention heads (and the attention heads, experts, vocabulary): greedy tokens and
    logprobs of a chunked prompt equal -tp 1's (fp32 noise), a repeated prompt hits the prefix cache on both,
    and a weight update by HF names reaches both shards (/weight_checker)."""
    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient
    from tests.test_tensor_parallel import _free_port
    from tests.tiny_models import make_tiny_checkpoint
    from workers.models.checkpoint import load_hf_config
    from workers.models.registry import shard_checksums

    folder = make_tiny_checkpoint("qwen3_next", tmp_path / "qwen3_next")
    prompt = [(17 * j + 5) % 900 + 3 for j in range(29)]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 0,
                                                     "ignore_eos": True}}
    out = {}
    for tp in (1, 2):
        s = start_server(tmp_path, "--model", str(folder), "-tp", str(tp), "--master-port", str(_free_port()),
                         "--block-size", "4", "--max-model-len", "128", "--max-num-batched-tokens", "16",
                         "--tokens-only", "--additional-config", '{"rl_config": {"enabled": true}}',
                         "--weight-transfer-config", json.dumps({"backend": "ipc", "timeout_s": 30}),
                         env={"VLLM_SERVER_DEV_MODE": "1"}, timeout_s=400)
        try:
            runs = [httpx.post(s.url + "/inference/v1/generate", json=body, timeout=120).json() for _ in range(2)]
            hits = metric(s, "vllm:prefix_cache_hits_total")
            if tp == 2:
                hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
                perturb(hf)
                with WeightSyncClient(s.url, backend="ipc") as client:
                    client.send_weights(hf.state_dict().items(), version="v1")
                baseline = shard_checksums(load_hf_config(folder), hf.state_dict().items(), 2)  # per shard
                check = httpx.post(s.url + "/weight_checker", timeout=60,
                                   json={"action": "compare", "baseline": baseline}).json()
        finally:
            s.stop()
        out[tp] = [(r["choices"][0]["token_ids"], [e["logprob"] for e in r["choices"][0]["logprobs"]["content"]])
                   for r in runs]
        assert hits == 28, f"-tp {tp}: the repeated prompt resumes at its last full block"
    assert out[1][0][0] == out[2][0][0] == out[2][1][0]
    assert max(abs(a - b) for a, b in zip(out[1][0][1], out[2][1][1])) < 1e-4
    assert check == {"match": True, "mismatches": []}
