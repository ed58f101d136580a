"""gpt-oss's MXFP4 checkpoints (as OpenAI publishes gpt-oss-20b / 120b): the experts dequantised as the
checkpoint is read (workers/models/mxfp4.py), bitwise what HF transformers dequantises, and the model then
equal to HF's on the same checkpoint (greedy tokens, every logprob within 1e-4, routed experts)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import _COMMON, MXFP4_CONFIG, TINY_CONFIGS, load_model, make_mxfp4_checkpoint, quantize_mxfp4
from workers.models.mxfp4 import dequantize, dequantized
from workers.models.registry import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


@pytest.mark.unit
def test_dequantize_is_transformers_dequantisation_bitwise() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)  # every code, both nibbles
    scales = torch.randint(0, 255, (3, 40, 4), dtype=torch.uint8, generator=g)  # 2**-127 .. 2**127
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize(blocks, scales, dtype)
        assert ours.shape == (3, 128, 40) and ours.dtype == dtype
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


@pytest.mark.unit
def test_pairs_join_in_either_order_and_half_a_pair_is_refused_naming_it() -> None:
    w = torch.randn(2, 8, 64)
    b, s = quantize_mxfp4(w)
    want = dequantize(b, s)
    assert (want.float().transpose(1, 2) - w).abs().max() <= w.abs().max() / 4  # a 4-bit round trip
    bias = torch.randn(8)
    for order in ([("x.w_blocks", b), ("y.bias", bias), ("x.w_scales", s)],
                  [("x.w_scales", s), ("x.w_blocks", b), ("y.bias", bias)]):
        got = dict(dequantized(order))
        assert set(got) == {"x.w", "y.bias"} and torch.equal(got["x.w"], want) and got["y.bias"] is bias
    with pytest.raises(ValueError, match="'x.w_blocks' has no 'x.w_scales'"):
        list(dequantized([("x.w_blocks", b)]))
    with pytest.raises(ValueError, match="'x.w_scales' appears twice"):
        list(dequantized([("x.w_scales", s), ("x.w_scales", s)]))
    with pytest.raises(ValueError, match="tensor 'x.w'.*do not match"):
        list(dequantized([("x.w_blocks", b[:, :, :1]), ("x.w_scales", s)]))


@pytest.mark.unit
def test_mxfp4_is_accepted_for_gpt_oss_only_and_other_methods_stay_refused() -> None:
    cfg = {**_COMMON, **TINY_CONFIGS["gpt_oss"][1], "intermediate_size": 64, "architectures": ["GptOssForCausalLM"]}
    build_model({**cfg, "quantization_config": MXFP4_CONFIG}, torch.float32, "meta")
    with pytest.raises(NotImplementedError, match="quant_method 'fp8'"):
        build_model({**cfg, "quantization_config": {"quant_method": "fp8"}}, torch.float32, "meta")
    mistral = {**_COMMON, **TINY_CONFIGS["mistral"][1], "architectures": ["MistralForCausalLM"]}
    with pytest.raises(NotImplementedError, match="MistralForCausalLM: quantization_config quant_method 'mxfp4'"):
        build_model({**mistral, "quantization_config": MXFP4_CONFIG}, torch.float32, "meta")


@pytest.fixture(scope="module")
def mxfp4_tiny(tmp_path_factory):
    folder = make_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    return "gpt_oss", folder, hf


def test_an_mxfp4_checkpoint_loads_as_hf_dequantises_it_and_equals_hf(mxfp4_tiny) -> None:
    from tests.test_arch_oracle import test_greedy_logprobs_and_routes_equal_hf as equals_hf

    _, folder, hf = mxfp4_tiny
    model = load_model(folder)
    theirs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert torch.equal(p, theirs[name].float()), name
    equals_hf(mxfp4_tiny)


def test_two_tensor_parallel_ranks_split_the_dequantised_experts(mxfp4_tiny) -> None:
    """-tp 2 on the MXFP4 folder: each rank dequantises the whole tensors and keeps its interleaved gate / up
    columns; the logits equal the unsharded model's."""
    from tests.test_arch_oracle import test_two_tensor_parallel_ranks_compute_what_one_does as sharded_equals_whole

    sharded_equals_whole(mxfp4_tiny)


@pytest.mark.slow
def test_served_mxfp4_gpt_oss_equals_hf_and_reloads_from_its_checkpoint(tmp_path, smollm2_dir) -> None:
    """`rollbus serve` on the MXFP4 folder: 3 concurrent greedy requests equal HF's (dequantising) tokens,
    prompt and sampled logprobs within 1e-4 and routed experts; after a level-2 sleep (weights discarded)
    `reload_weights` dequantises the checkpoint again and a request alone equals HF's as well (not bitwise
    the batched one's: gpt-oss does not run batch invariant)."""
    import base64
    import io
    import shutil
    import threading

    import httpx
    import numpy as np

    from tests.server_helpers import start_server
    from tests.test_arch_oracle import hf_routes

    folder = make_mxfp4_checkpoint(tmp_path / "gpt_oss_mxfp4")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    prompts = [[(19 * i + 5 * j * j) % 900 + 3 for j in range(7 + 6 * i)] for i in range(3)]
    body = {"model": str(folder), "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    s = start_server(tmp_path, str(folder), "--block-size", "4", "--max-model-len", "128", "--enable-sleep-mode",
                     "--enable-return-routed-experts", "--additional-config", '{"rl_config": {"enabled": true}}')
    got: dict[int, dict] = {}

    def go(i: int) -> None:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": prompts[i]})
        assert r.status_code == 200, r.text
        got[i] = r.json()["choices"][0]

    try:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for path, payload in [("/sleep?level=2", None), ("/wake_up", None),
                              ("/collective_rpc", {"method": "reload_weights"})]:
            r = httpx.post(s.url + path, timeout=120, json=payload)
            assert r.status_code == 200, (path, r.text)
        again = httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": prompts[2]}).json()
    finally:
        s.stop()
    assert again["choices"][0]["logprobs"]["tokens"] == got[2]["logprobs"]["tokens"]
    for i, c in [*got.items(), (2, again["choices"][0])]:  # the reloaded weights checked against HF too
        p = prompts[i]
        ids = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        lp, routes = hf_routes(hf, p + ids)
        assert ids == lp[len(p) - 1:-1].argmax(-1).tolist(), f"prompt {i}: greedy tokens differ from HF"
        want = [lp[k - 1, t].item() for k, t in enumerate(p + ids) if k]
        served = [next(iter(d.values()))["logprob"] for d in c["prompt_logprobs"][1:]] + c["logprobs"]["token_logprobs"]
        assert len(served) == len(want) and max(abs(a - b) for a, b in zip(served, want)) < 1e-4
        rows = np.sort(np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False), axis=-1)
        assert np.array_equal(rows, routes[:-1].numpy()), f"prompt {i}: routed experts differ from HF"


# openai/gpt-oss-20b's config.json as published (transformers 4.55 keys: rope_scaling, rope_theta at the top)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": MXFP4_CONFIG, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}


@pytest.mark.unit
def test_gpt_oss_20b_as_published_builds_with_hfs_rope_and_takes_its_mxfp4_experts() -> None:
    """The real config (on the meta device): MXFP4 accepted, windows of 128 on every other layer, the expert
    tensors the shapes its *_blocks dequantise to, and YaRN's cos / sin tables equal to HF's rotary embedding."""
    from workers.models.decoder_config import _rope_tables
    from workers.models.gpt_oss import GptOssConfig

    model = build_model(GPT_OSS_20B, torch.bfloat16, "meta")
    assert model.cfg.windows == (128, 0) * 12 and model.num_experts == 32 and model.moe_top_k == 4
    e, h, i = 32, 2880, 2880
    # gate_up_proj_blocks [E, 2I, H / 32, 16] -> [E, H, 2I]; down_proj_blocks [E, H, I / 32, 16] -> [E, I, H]
    assert model.weight_full_shape("model.layers.0.mlp.experts.gate_up_proj") == (e, h, 2 * i)
    assert model.weight_full_shape("model.layers.0.mlp.experts.down_proj") == (e, i, h)
    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf_cfg)
    pos = torch.arange(0, 131072, 61)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos[None])
    ours_cos, ours_sin = _rope_tables(GptOssConfig.from_hf(GPT_OSS_20B), 131072, torch.device("cpu"), torch.float32)
    assert torch.equal(ours_cos[pos, :32], cos[0]) and torch.equal(ours_sin[pos, :32], sin[0])
