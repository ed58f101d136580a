"""LoRA on a mixture-of-experts model (tiny Qwen3-MoE: 8 experts, top-2, layer 1 a dense MLP; fp32, batch
invariance on): adapters on the attention and on the experts (PEFT 0.21 on transformers 5 turns gate/up/down
targets into `target_parameters` on the stacked mlp.experts, gate and up fused at rank 2r) give logprobs
within 1e-4 of HF + PEFT, from a folder and pushed; a mixed batch (attention, experts, the base) is bitwise
the same as each request alone; an MLP adapter on the dense layer equals the merged weight; what is not
supported is a 400 naming it, and the adapter that served keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine.trainer import WeightSyncClient, WeightSyncFailed
from tests.lora_helpers import check_peft, make_adapter
from tests.serve_process import start_server
from tests.tiny_models import make_tiny_checkpoint, random_prompt

pytest.importorskip("peft")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
RL = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    base = make_tiny_checkpoint("qwen3_moe", root / "base")
    ad = {"a": make_adapter(base, root / "a", rank=4, seed=1, targets=ATTN),
          "e": make_adapter(base, root / "e", rank=4, seed=2, targets=["q_proj", "v_proj", *MLP]),
          "d": make_adapter(base, root / "d", rank=8, seed=3, targets=["down_proj"], alpha=4),
          "p": make_adapter(base, root / "p", rank=4, seed=4, targets=["o_proj", *MLP], rslora=True)}
    conf = json.loads((ad["e"] / "adapter_config.json").read_text())
    assert sorted(conf["target_parameters"]) == ["down_proj", "gate_up_proj"] and conf["rank_pattern"]
    server = start_server(root, str(base), "--tokens-only", "--enable-lora", "--max-lora-rank", "8",
                          "--max-loras", "4", "--lora-modules", f"a={ad['a']}", f"e={ad['e']}", "--block-size", "4",
                          "--additional-config", RL,
                          "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 30}',
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield server, base, root, ad
    server.stop()


def _gen(url: str, model: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_expert_lora_from_folders_and_pushed_matches_peft_and_mixes_bitwise(moe):
    server, base, _, ad = moe
    base_name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    plain = _gen(server.url, base_name, random_prompt(7, 1000, 5))["logprobs"]["token_logprobs"]
    for name in ("a", "e"):
        assert check_peft(server.url, base, ad[name], name, 1) != pytest.approx(plain, abs=1e-3)
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60, json={"lora_name": "d", "lora_path": str(ad["d"])})
    assert r.status_code == 200, r.text
    check_peft(server.url, base, ad["d"], "d", 1)  # down_proj alone: target_parameters ["down_proj"], rank 8
    p = ad["p"]
    with WeightSyncClient(server.url, backend="ipc") as client:
        client.send_lora("pushed", load_file(str(p / "adapter_model.safetensors")).items(),
                         json.loads((p / "adapter_config.json").read_text()))
    check_peft(server.url, base, p, "pushed", 1)

    models = ["e", "a", base_name, "d", "pushed", "e"]
    prompts = [random_prompt(9, 1000, s) for s in range(len(models))]
    alone = [_gen(server.url, m, q) for m, q in zip(models, prompts)]
    with cf.ThreadPoolExecutor(len(models)) as ex:
        mixed = list(ex.map(lambda mq: _gen(server.url, *mq), zip(models, prompts)))
    for x, y in zip(alone, mixed):
        assert x["token_ids"] == y["token_ids"]
        assert x["logprobs"]["token_logprobs"] == y["logprobs"]["token_logprobs"]


def test_mlp_lora_on_the_dense_layer_equals_the_merged_weight(moe):
    """PEFT on transformers 5 maps every down_proj target to the experts, so the dense layer's MLP is pushed
    by name; the oracle is HF with W + scaling * B @ A merged."""
    import transformers

    server, base, _, _ = moe
    g = torch.Generator().manual_seed(5)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_"
    a, b = torch.randn(4, 160, generator=g) * 0.2, torch.randn(64, 4, generator=g) * 0.2
    conf = {"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]}
    with WeightSyncClient(server.url, backend="ipc") as client:
        client.send_lora("dense", [(key + "A.weight", a), (key + "B.weight", b)], conf)
    prompt = random_prompt(7, 1000, 5)
    choice = _gen(server.url, "dense", prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight += 2.0 * b @ a
        ref = torch.log_softmax(hf(torch.tensor([prompt + choice["token_ids"]])).logits[0], -1)
    for i, (t, lp) in enumerate(zip(choice["token_ids"], choice["logprobs"]["token_logprobs"])):
        assert abs(float(ref[len(prompt) - 1 + i, t]) - lp) < 1e-4


def test_what_is_not_supported_is_a_400_naming_it(moe):
    server, base, root, ad = moe
    before = check_peft(server.url, base, ad["e"], "e", 1)
    bad = root / "bad"
    shutil.copytree(ad["e"], bad, dirs_exist_ok=True)
    conf = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "target_parameters": ["mlp.gate.weight"]}))
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "e", "lora_path": str(bad), "load_inplace": True})
    assert r.status_code == 400 and "target_parameters 'mlp.gate.weight' is not supported" in r.text, r.text
    tensors = load_file(str(ad["a"] / "adapter_model.safetensors"))
    expert_mlp = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"  # layer 0's MLP is the experts
    with WeightSyncClient(server.url, backend="ipc") as client:
        with pytest.raises(WeightSyncFailed, match="is not a LoRA A/B of a target projection"):
            client.send_lora("pushed2", [*tensors.items(), (expert_mlp, torch.zeros(4, 48))],
                             {"r": 4, "lora_alpha": 8, "target_modules": ATTN})
        with pytest.raises(WeightSyncFailed, match="rank_pattern '.*' on model.layers.0.self_attn.q_proj"):
            client.send_lora("pushed2", tensors.items(), {"r": 4, "rank_pattern": {"q_proj": 2}})
    assert check_peft(server.url, base, ad["e"], "e", 1) == pytest.approx(before, abs=1e-6)  # nothing changed
