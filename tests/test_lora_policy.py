"""LoRA in the scheduler's policy: --max-loras bounds the adapters running at once, and the prefix cache never
serves a block computed with another adapter or another version of it."""

import pytest

from bus.sampling_params import LoraRef, SamplingParams
from engine.block_manager import BlockManager
from engine.request import Sequence
from engine.scheduler import Scheduler

pytestmark = pytest.mark.unit


def _seq(sid: str, lora: LoraRef | None, prompt=tuple(range(1, 14))) -> Sequence:
    return Sequence(sid, list(prompt), SamplingParams(max_tokens=1, lora=lora), eos_token_ids=[0])


def _finish(s: Scheduler) -> list[str]:
    step = s.schedule()
    s.update(step, {q.seq_id: (7, -1.0, None) for q in step.seqs})
    return [q.seq_id for q in step.seqs]


def test_max_loras_holds_a_third_adapter_until_one_is_done():
    s = Scheduler(BlockManager(64, 4), 8, 256, 128, max_loras=2)
    a, b, c = (LoraRef(i, n, "/x", 1) for i, n in ((1, "a"), (2, "b"), (3, "c")))
    for sid, ref in (("1", a), ("2", b), ("3", c)):
        s.add(_seq(sid, ref, prompt=range(int(sid) * 20, int(sid) * 20 + 5)))
    assert _finish(s) == ["1", "2"]  # c waits: two adapters run already
    assert _finish(s) == ["3"]


def test_prefix_cache_is_keyed_by_adapter_and_version():
    s = Scheduler(BlockManager(64, 4), 8, 256, 128)
    v1, v2, other = LoraRef(1, "a", "/x", 1), LoraRef(1, "a", "/x", 2), LoraRef(2, "b", "/y", 1)
    s.add(_seq("first", v1))
    _finish(s)
    for sid, ref, hit in (("same", v1, True), ("newer", v2, False), ("other", other, False), ("base", None, False)):
        q = _seq(sid, ref)
        s.add(q)
        _finish(s)
        assert (q.num_cached_tokens > 0) == hit, sid


def test_lora_flags_parse_and_refuse_what_is_not_implemented():
    from engine.config import parse_config
    from engine.lora import parse_lora_modules

    cfg = parse_config(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--lora-dtype", "bfloat16",
                        "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert (cfg.lora.max_loras, cfg.lora.max_lora_rank, cfg.lora.lora_dtype) == (2, 32, "bfloat16")
    assert [(m.name, m.path, m.base_model_name) for m in parse_lora_modules(cfg.lora.lora_modules)] == [
        ("a", "/x", None), ("b", "/y", "m")]
    assert parse_config(["--enable-lora", "-tp", "2"]).parallel.tensor_parallel_size == 2  # split as vLLM does
    for argv, why in ((["--lora-modules", "a=/x"], "--enable-lora"),
                      (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
                      (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras")):
        with pytest.raises(SystemExit, match=why):
            parse_config(argv)


def test_enable_lora_refuses_multi_head_latent_attention_and_serves_moe(tmp_path):
    import json

    from engine.lora import model_problem, targets

    dense = {"model_type": "qwen3", "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**dense, "kv_lora_rank": 512}))
    assert "multi-head latent attention (kv_lora_rank)" in model_problem(tmp_path)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        (tmp_path / "config.json").write_text(json.dumps({**dense, key: 8}))
        assert model_problem(tmp_path) is None
        assert targets({**dense, key: 8}) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert "down_proj" in targets(dense)


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 3,
             "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 160, "moe_intermediate_size": 48, "num_experts": 8, "mlp_only_layers": [1]}


def test_expert_lora_config_resolves_peft_target_parameters_and_refuses_the_rest_by_name():
    from engine.lora import LoraError, adapter_factors, expert_key, lora_key, lora_shape, sparse_layers, targets

    hf = QWEN3_MOE
    assert sparse_layers(hf) == (0, 2) and targets(hf, 1)[-1] == "down_proj" and "down_proj" not in targets(hf, 0)
    # PEFT 0.21 on transformers 5 for gate/up/down at r=4, alpha=8: gate and up fused at rank 8, alpha 16
    conf = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": ["down_proj", "gate_up_proj"],
            "rank_pattern": {r".*\.gate_up_proj": 8}, "alpha_pattern": {r".*\.gate_up_proj": 16}}
    f = adapter_factors("x", conf, hf, max_rank=4)
    assert f.experts == {"gate_up_proj": (8, 2.0), "down_proj": (4, 2.0)} and (f.rank, f.scaling) == (4, 2.0)
    # nested ParamWrappers: the first targeted parameter is the innermost (base_layer)
    inner, outer = (expert_key(0, p, f.experts, "A") for p in ("gate_up_proj", "down_proj"))
    assert inner.endswith("mlp.experts.base_layer.lora_A.weight") and outer.endswith("mlp.experts.lora_A.weight")
    assert lora_key(inner, hf, f.experts) == (0, "experts.gate_up_proj", "A")
    assert lora_key(outer.replace("layers.0", "layers.1"), hf, f.experts) is None  # layer 1 is dense
    assert lora_shape(f, "experts.gate_up_proj", "B", hf) == [96, 64] and lora_shape(f, "experts.down_proj", "A",
                                                                                     hf) == [32, 48]
    for bad, why in ((["mlp.gate.weight"], "target_parameters 'mlp.gate.weight' is not supported"),
                     (["layers.0.mlp.experts.down_proj"], "is not supported")):  # not every MoE layer
        with pytest.raises(LoraError, match=why):
            adapter_factors("x", {**conf, "target_parameters": bad}, hf, max_rank=4)
    with pytest.raises(LoraError, match="rank_pattern 'q_proj' on model.layers.0.self_attn.q_proj"):
        adapter_factors("x", {**conf, "rank_pattern": {"q_proj": 2}}, hf, max_rank=4)
    with pytest.raises(LoraError, match="LoRA rank 8 of the experts' down_proj is greater than max_lora_rank 4"):
        adapter_factors("x", {**conf, "rank_pattern": {r"experts\.down_proj": 8}}, hf, max_rank=4)
    dense = {**hf, "architectures": ["LlamaForCausalLM"], "num_experts": 0}
    with pytest.raises(LoraError, match="LoRA on parameters is served on the experts of"):
        adapter_factors("x", conf, dense, max_rank=4)
