"""Prefix caching for hybrid models (Qwen3-Next / Qwen3.5): the Gated DeltaNet state is checkpointed at the end
of each prompt's last full block (engine.state_checkpoints) and a prefix hit resumes from it. Policy units (the
checkpoint pool, the hit cut back to a checkpointed block, the chunk cut at the boundary, the budget), then one
batch-invariant server (--mamba-block-size 8): a repeated prompt, a longer prompt containing it and one sharing
only its first 17 tokens hit the cache, and their tokens and logprobs are bitwise those of the same requests
computed cold (a cache_salt that matches nothing)."""

from __future__ import annotations

import struct

import httpx
import pytest

from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.config import parse_config
from engine.request import Sequence
from engine.scheduler.policy import Scheduler
from engine.state_checkpoints import StateCheckpoints, checkpoint_boundary, next_checkpoint
from tests.server_helpers import metric, start_server
from tests.tiny_models import hf_config_class, make_tiny_checkpoint
from workers.kv_cache import plan_checkpoints

pytestmark = pytest.mark.timeout(300)
ON = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


def _sched(checkpoints: int, num_blocks: int = 64, budget: int = 64, every: int = 0) -> Scheduler:
    blocks = BlockManager(num_blocks, 4, checkpoints=StateCheckpoints(checkpoints))
    return Scheduler(blocks, 4, budget, 256, state_slots=4, checkpoint_every=every)


def _run(sched: Scheduler, seq: Sequence) -> list:
    """Schedule `seq` alone until it has sampled its first token (7), then end it; returns its steps."""
    sched.add(seq)
    steps = []
    while not seq.output_token_ids:
        step = sched.schedule()
        steps.append(step)
        sched.update(step, {s.seq_id: (7, -1.0, None) for s, n, b in zip(step.seqs, step.num_new, step.num_computed)
                            if b + n == s.num_tokens})
    sched.abort(seq.seq_id)
    return steps


@pytest.mark.unit
def test_a_prompt_checkpoints_its_last_full_block_and_a_repeat_resumes_there() -> None:
    assert [checkpoint_boundary(n, 4) for n in (1, 4, 5, 8, 9, 23)] == [0, 0, 4, 4, 8, 20]
    sched = _sched(2)
    prompt = list(range(1, 24))  # 23 tokens: the boundary is 20
    first = _run(sched, Sequence("a", prompt, SamplingParams(max_tokens=4), []))
    assert [s.num_new for s in first] == [[20], [3]]  # the prefill ends on the boundary, then the rest
    assert [(s.seq_id, i) for s, _, i in first[0].saves] == [("a", 4)] and not first[1].saves
    again = _run(sched, Sequence("b", prompt, SamplingParams(max_tokens=4), []))
    assert again[0].num_computed == [20] and [(s.seq_id, c) for s, c in again[0].loads] == [("b", 0)]
    assert not again[0].saves  # the hit covers the boundary already
    # a longer prompt sharing those 23 tokens: blocks 0-4 match and block 4 has the checkpoint
    longer = _run(sched, Sequence("c", prompt + [99] * 9, SamplingParams(max_tokens=4), []))
    assert longer[0].num_computed == [20] and longer[0].loads[0][1] == 0
    assert [s.num_new for s in longer] == [[8], [4]]  # to its own boundary 28, then the rest
    # a prompt sharing only its first 12 tokens: blocks 0-2 match, none with a checkpoint: no hit
    other = _run(sched, Sequence("d", prompt[:12] + [50] * 11, SamplingParams(max_tokens=4), []))
    assert other[0].num_computed == [0] and not other[0].loads


@pytest.mark.unit
def test_mamba_block_size_checkpoints_every_n_prompt_tokens_so_a_shared_system_prompt_hits() -> None:
    assert [next_checkpoint(23, 4, c, 8) for c in (0, 7, 8, 15, 16, 19, 20)] == [8, 8, 16, 16, 20, 20, 0]
    sched = _sched(8, every=8)
    prompt = list(range(1, 24))
    first = _run(sched, Sequence("a", prompt, SamplingParams(max_tokens=4), []))
    assert [s.num_new for s in first] == [[8], [8], [4], [3]]  # chunks end on 8, 16 and the last full block
    assert [i for s in first for _, _, i in s.saves] == [1, 3, 4]
    other = _run(sched, Sequence("b", prompt[:17] + [50] * 11, SamplingParams(max_tokens=4), []))
    assert other[0].num_computed == [16] and other[0].loads  # the shared 17 tokens resume at 16
    with pytest.raises(SystemExit, match="multiple of --block-size 16"):
        parse_config(["--model", "/m", "--mamba-block-size", "24"])
    with pytest.raises(SystemExit, match="--no-enable-prefix-caching turns that cache off"):
        parse_config(["--model", "/m", "--mamba-block-size", "32", "--no-enable-prefix-caching"])


@pytest.mark.unit
def test_a_system_prompt_shared_by_a_batch_outlives_each_prompts_own_checkpoint() -> None:
    """Four prompts running together share a 16-token system prompt, in a pool of four checkpoints: their own
    prompt-end checkpoints do not evict the shared one (asked for by all four), so the next batch of other
    questions resumes at 16 (--mamba-block-size 8)."""
    sched = _sched(4, every=8)
    system = list(range(100, 116))

    def batch(r: int) -> list[Sequence]:
        seqs = [Sequence(f"{r}-{i}", system + [200 + 10 * r + i] * 9, SamplingParams(max_tokens=1), [])
                for i in range(4)]
        for q in seqs:
            sched.add(q)
        while sched.has_work():
            step = sched.schedule()
            sched.update(step, {q.seq_id: (7, -1.0, None) for q, n, b in zip(step.seqs, step.num_new,
                                                                               step.num_computed)
                                if b + n == q.num_tokens})
        return seqs

    assert [q.num_cached_tokens for q in batch(0)] == [0] * 4
    assert [q.num_cached_tokens for q in batch(1)] == [16] * 4
    assert [q.num_cached_tokens for q in batch(2)] == [16] * 4


@pytest.mark.unit
def test_checkpoints_are_evicted_with_their_blocks_lru_and_given_back_by_a_failed_step() -> None:
    pool = StateCheckpoints(2)
    a, b = pool.take(111), pool.take(222)
    pool.commit(a, 111), pool.commit(b, 222)
    assert 111 in pool and pool.load(111) == a  # 111 used last: 222 goes first
    c = pool.take(333)
    assert c == b and 222 not in pool and 111 in pool
    # a state kept already, or being saved, is not saved twice (requests with one prefix, running together)
    assert pool.take(111) is None and pool.take(333) is None
    pool.release(c)
    assert pool.free == [c] and not pool.pending
    # the block manager forgets a checkpoint when its block's hash is evicted
    sched = _sched(4, num_blocks=8)
    _run(sched, Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=1), []))
    assert len(sched.blocks.checkpoints.by_hash) == 1
    _run(sched, Sequence("b", list(range(50, 80)), SamplingParams(max_tokens=1), []))  # needs every block
    assert len(sched.blocks.checkpoints.by_hash) == 1  # a's was evicted with its block, b's is there
    sched.blocks.reset_prefix_cache()
    assert not sched.blocks.checkpoints.by_hash and len(sched.blocks.checkpoints.free) == 4
    sched.add(Sequence("e", list(range(1, 10)), SamplingParams(max_tokens=1), []))
    step = sched.schedule()
    assert step.saves and len(sched.blocks.checkpoints.free) == 3
    sched.discard_saves(step)
    assert len(sched.blocks.checkpoints.free) == 4


@pytest.mark.unit
def test_checkpoints_come_out_of_the_block_budget() -> None:
    # room for 100 blocks of 1,000 bytes; a checkpoint of 2,500 bytes; a quarter of the blocks' bytes at most
    assert plan_checkpoints(100, bytes_per_block=1000, bytes_per_slot=2500, max_num_seqs=8, min_blocks=10,
                            extra=False) == (8, 80)
    assert plan_checkpoints(100, bytes_per_block=1000, bytes_per_slot=2500, max_num_seqs=256, min_blocks=10,
                            extra=False) == (10, 75)
    assert plan_checkpoints(12, bytes_per_block=1000, bytes_per_slot=2500, max_num_seqs=8, min_blocks=10,
                            extra=False) == (0, 12)  # no room beside one max-model-len sequence: caching off
    assert plan_checkpoints(12, bytes_per_block=1000, bytes_per_slot=2500, max_num_seqs=8, min_blocks=10,
                            extra=True) == (8, 12)


def _bits(body: dict) -> tuple[list[int], list[int]]:
    content = body["choices"][0]["logprobs"]["content"]
    return body["choices"][0]["token_ids"], [struct.unpack("<I", struct.pack("<f", e["logprob"]))[0] for e in content]


def test_a_prefix_hit_on_a_hybrid_gives_the_bits_of_a_cold_run(tmp_path):
    hf_config_class("Qwen3NextConfig")
    folder = make_tiny_checkpoint("qwen3_next", tmp_path / "qwen3_next")
    s = start_server(tmp_path, "--model", str(folder), "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--max-model-len", "128", "--max-num-seqs", "8", "--tokens-only", "--additional-config", ON,
                     "--mamba-block-size", "8")
    prompt = [(37 * j + 11) % 990 + 5 for j in range(23)]
    longer = prompt + [(13 * j + 5) % 990 + 5 for j in range(14)]
    shared = prompt[:17] + [(7 * j + 3) % 990 + 5 for j in range(10)]  # resumes at 16 (--mamba-block-size 8)

    def gen(p: list[int], salt: str | None = None) -> dict:
        body = {"token_ids": p, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 3,
                                                    "ignore_eos": True, "logprobs": 0}}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(s.url + "/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        cold = [gen(prompt, "cold-a"), gen(longer, "cold-b"), gen(shared, "cold-c")]  # salts that match nothing
        first = gen(prompt)
        hits = [gen(prompt), gen(longer), gen(shared)]
        cached = [h["usage"]["prompt_tokens_details"]["cached_tokens"] for h in hits]
        info = httpx.get(s.url + "/server_info?config_format=json", timeout=10).json()
        hit_tokens = metric(s, "vllm:prefix_cache_hits_total")
    finally:
        s.stop()
    assert cached == [20, 20, 16] and hit_tokens == 56
    assert info["vllm_config"]["cache_config"]["enable_prefix_caching"] is True
    assert _bits(first) == _bits(cold[0])
    assert [_bits(h) for h in hits] == [_bits(c) for c in cold]
