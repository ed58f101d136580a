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
