"""The recurrent-state pool of hybrid models (Qwen3-Next / Qwen3.5) and its contract: one budget with the KV
blocks (refused at start-up when it cannot hold --max-num-seqs slots and a block), one slot per running sequence
handed out by the scheduler and given back on preemption and finish, a fresh slot zeroed, a row that would
resume from another position's state refused (never a silently wrong result), -tp splitting the linear heads
or refused naming them; and the
Qwen3.5 text variants (split projections, dense and MoE) equal HF. Batch invariance: test_hybrid_invariance.py."""

from __future__ import annotations

import pytest
import torch

from ascend_ops.platform import current_platform
from ascend_ops.tp_group import Layout
from bus.messages import NewSeq, StepPlan
from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import Sequence
from engine.scheduler.policy import Scheduler
from tests.tiny_models import (
    _COMMON,
    TINY_CONFIGS,
    PagedRunner,
    hf_config_class,
    load_model,
    make_tiny_checkpoint,
    random_prompt,
)
from workers.kv_cache import KVCache, plan_num_blocks
from workers.model_runner import ModelRunner
from workers.models.registry import build_model

transformers = pytest.importorskip("transformers")


def _cfg(arch: str = "qwen3_next") -> dict:
    cls, extra = TINY_CONFIGS[arch]
    return {**hf_config_class(cls)(**{**_COMMON, **extra}).to_dict(),
            "architectures": ["Qwen3NextForCausalLM" if arch == "qwen3_next" else "Qwen3_5ForCausalLM"]}


@pytest.mark.unit
def test_the_state_pool_is_part_of_the_cache_and_its_budget() -> None:
    model = build_model(_cfg(), torch.float32, "meta")
    spec = model.state_spec
    assert model.kv_spec.num_layers == 1 and spec.num_layers == 2  # one attention layer, two linear ones
    per_slot = KVCache.bytes_per_state_slot(spec, torch.float32)
    assert per_slot == 2 * (spec.conv[0] * spec.conv[1] + 4 * 16 * 16) * 4
    kv = KVCache.for_model(model, 4, 10, torch.float32, torch.device("cpu"), state_slots=3)
    assert kv.conv_state.shape == (2, 3, *spec.conv) and kv.rec_state.dtype == torch.float32
    assert [v[0].shape[0] for v in kv.views] == [3, 10, 3]  # linear, attention (blocks), linear
    assert kv.nbytes == kv.tensor.numel() * 4 + 3 * per_slot
    kv.conv_state.fill_(1.0), kv.rec_state.fill_(1.0)
    kv.reset_state([1])
    assert kv.rec_state[:, 1].abs().sum() == 0 and kv.rec_state[:, 0].abs().sum() > 0
    kv.release()
    assert kv.nbytes == 0 and kv.views == []
    kv.allocate()  # woken: zeroed, the views again
    assert kv.rec_state.abs().sum() == 0 and len(kv.views) == 3
    per_block = KVCache.bytes_per_block(*model.kv_spec, 4, torch.float32)

    def blocks(budget: int, reserved: int) -> int:
        return plan_num_blocks(current_platform(), bytes_per_block=per_block, kv_cache_memory_bytes=budget,
                               num_blocks_override=None, gpu_memory_utilization=None, device_index=0,
                               reserved_bytes=reserved)

    assert blocks(8 * per_slot + 5 * per_block + 7, 8 * per_slot) == 5  # the pool first, the rest in blocks
    with pytest.raises(ValueError, match="recurrent-state pool .*--max-num-seqs"):
        blocks(8 * per_slot, 8 * per_slot)


@pytest.mark.unit
def test_the_scheduler_gives_each_running_sequence_a_slot_and_takes_it_back() -> None:
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 2, 64, 128, state_slots=2)
    seqs = [Sequence(f"s{i}", list(range(1, 6)), SamplingParams(max_tokens=4), []) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s.seq_id for s in step.seqs] == ["s0", "s1"] and [s.state_slot for s in step.seqs] == [0, 1]
    sched._preempt(seqs[1])
    assert seqs[1].state_slot == -1 and sched.free_slots == [1]
    sched.abort("s0")
    assert seqs[0].state_slot == -1 and sorted(sched.free_slots) == [0, 1]


@pytest.mark.unit
def test_a_fresh_slot_is_zeroed_and_a_row_cannot_resume_from_another_positions_state(tmp_path) -> None:
    model = build_model(_cfg(), torch.float32, "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    kv = KVCache.for_model(model, 4, 16, torch.float32, torch.device("cpu"), state_slots=2)
    runner = ModelRunner(model, kv, rank=0, block_size=4, device=torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    kv.rec_state.fill_(3.0)  # what a finished sequence left in the slots
    first = runner.execute(StepPlan(1, [NewSeq("a", [5, 6, 7], greedy, [])], ["a"], [0], [3], [[0]], [], 0, [1]))
    assert kv.rec_state[:, 0].eq(3.0).all() and not kv.rec_state[:, 1].eq(3.0).any()
    # the same prompt in the other (dirty) slot gives the same token and logprob: the slot was zeroed
    again = runner.execute(StepPlan(2, [NewSeq("b", [5, 6, 7], greedy, [])], ["b"], [0], [3], [[1]], [], 0, [0]))
    assert again.token_ids.tolist() == first.token_ids.tolist() and again.logprobs.tolist() == first.logprobs.tolist()
    with pytest.raises(RuntimeError, match="resumes at position 2 but its state slot 1 holds position 3"):
        runner.execute(StepPlan(3, [NewSeq("c", [5, 6, 7, 8], greedy, [])], ["c"], [2], [2], [[2]], [], 0, [1]))


@pytest.mark.unit
def test_tensor_parallelism_splits_the_linear_heads_or_is_refused_naming_them() -> None:
    half = build_model(_cfg(), torch.float32, "meta", tp=Layout(1, 2))
    full = build_model(_cfg(), torch.float32, "meta")
    assert half.state_spec.recurrent[0] * 2 == full.state_spec.recurrent[0]  # half the value heads' state
    assert half.state_spec.conv[0] * 2 == full.state_spec.conv[0]
    with pytest.raises(NotImplementedError, match="4 does not divide the model's 2 linear-attention heads "
                                                  "\\(linear_num_key_heads\\)"):
        build_model(_cfg(), torch.float32, "meta", tp=Layout(0, 4))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_text_models_equal_hf_across_chunks_and_decodes(arch, tmp_path) -> None:
    """A prompt of 100 tokens prefilled in chunks of 1, 63 and 30 (the state carried across chunks and the
    64-token chunks of the delta rule), then 6 decodes: every row's log-probs within 1e-4 of HF's."""
    folder = make_tiny_checkpoint(arch, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = random_prompt(100, 1000, 9)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    r = PagedRunner(load_model(folder), num_blocks=40)
    rows = [r.step(prefills=[(0, ids[:1])]), r.step(prefills=[(0, ids[1:64])]), r.step(prefills=[(0, ids[64:94])])]
    rows += [r.step(decodes=[(0, t)]) for t in ids[94:]]
    assert (torch.cat(rows).log_softmax(-1) - want).abs().max().item() < 1e-4


@pytest.mark.unit
def test_sleep_discards_the_pool_or_keeps_it_with_offloaded_blocks() -> None:
    from workers.sleep import SleepManager

    model = build_model(_cfg(), torch.float32, "cpu")
    kv = KVCache.for_model(model, 4, 8, torch.float32, torch.device("cpu"), state_slots=2)
    sleep = SleepManager(model, kv, current_platform())
    kv.rec_state.fill_(2.0), kv.conv_state.fill_(3.0)
    sleep.sleep(1, kv_blocks=[1, 2])  # SkyRL's offloaded sleep: the kept requests' states come back
    assert kv.conv_state is None
    sleep.wake(None)
    assert kv.rec_state.eq(2.0).all() and kv.conv_state.eq(3.0).all()
    sleep.sleep(2)  # a plain sleep: discarded with the blocks
    sleep.wake(None)
    assert kv.rec_state.abs().sum() == 0 and kv.conv_state.abs().sum() == 0


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_lora_is_refused_before_start_naming_the_hybrid_layers(arch, tmp_path) -> None:
    import json

    from engine.lora import model_problem
    from workers.lora import attach

    (tmp_path / "config.json").write_text(json.dumps(_cfg(arch)))
    assert "hybrid linear-attention model" in (model_problem(tmp_path) or "")
    with pytest.raises(NotImplementedError, match="hybrid linear-attention model"):
        attach(build_model(_cfg(arch), torch.float32, "meta"), None)


def test_qwen3_5_split_projections_on_two_tensor_parallel_ranks_compute_what_one_does(tmp_path) -> None:
    """Qwen3.5's separate in_proj_qkv / z / b / a split by linear-attention head over two ranks (threads): a
    prefill and a decode give -tp 1's logits (fp32 noise)."""
    from tests.test_arch_oracle import on_two_thread_ranks

    folder = make_tiny_checkpoint("qwen3_5", tmp_path)
    prompt = random_prompt(20, 1000, 3)

    def run(model) -> torch.Tensor | None:
        r = PagedRunner(model)
        first = r.step(prefills=[(0, prompt[:19])])
        last = r.step(decodes=[(0, prompt[19])])
        return None if first is None else torch.cat([first, last])

    got = on_two_thread_ranks(folder, run)
    assert got[1] is None and (got[0] - run(load_model(folder))).abs().max().item() < 1e-4
