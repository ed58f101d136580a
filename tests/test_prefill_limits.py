"""The scheduler's two limits on prefill chunks (engine/scheduler/policy.py): a step's prefill tokens while
anything decodes (--prefill-tokens-beside-decodes), and vLLM's per-request --long-prefill-token-threshold."""

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from tests.test_scheduler import run_step, seq

pytestmark = pytest.mark.unit


def make(budget=64, **limits):
    limits.setdefault("prefill_keys_per_token", 0)  # tokens unweighed by their keys, but in the last test
    return Scheduler(BlockManager(256, 4), 16, budget, 1024, **limits)


def chunks(step) -> dict[str, int]:
    return dict(zip(step.seq_ids, step.num_new))


def test_a_long_prompt_takes_the_whole_budget_when_nothing_decodes():
    s = make(prefill_beside_decodes=8)
    s.add(seq("long", n_prompt=200, max_tokens=2))
    assert [chunks(run_step(s)[0]) for _ in range(3)] == [{"long": 64}] * 3


def test_beside_decodes_long_prompts_share_the_limit_and_short_ones_come_in_whole():
    s = make(prefill_beside_decodes=8)
    s.add(seq("d", n_prompt=4, max_tokens=100))
    s.add(seq("e", n_prompt=4, max_tokens=100))
    run_step(s)  # d's and e's prompts: they decode from now on, as many as the long prompts below
    s.add(seq("long", n_prompt=14, max_tokens=2))
    s.add(seq("long2", n_prompt=12, max_tokens=2))
    s.add(seq("short", n_prompt=5, max_tokens=2))
    got = [chunks(run_step(s)[0]) for _ in range(4)]
    assert got == [{"d": 1, "e": 1, "long": 8},  # long2 waits: the long prompts' 8 are spent (short behind it)
                   {"d": 1, "e": 1, "long": 6, "long2": 2, "short": 5},  # long's last 6 and long2's first 2
                   {"d": 1, "e": 1, "long": 1, "short": 1, "long2": 8},
                   {"d": 1, "e": 1, "long2": 2}]  # long and short reached max_tokens=2


def test_a_short_suffix_after_a_cached_prefix_comes_in_whole():
    """A conversation's next turn resends it whole: long by its length, short by what it has left to compute
    (its cached prefix is reused), so it is admitted whole beside the decodes; a fresh long prompt still takes
    only the limit."""
    s = make(prefill_beside_decodes=8)
    for c in ("c", "e"):
        s.add(seq(c, n_prompt=20, max_tokens=1))
    run_step(s)  # both turns done, their prompts' blocks cached
    for d in ("d1", "d2", "d3"):
        s.add(seq(d, n_prompt=4, max_tokens=100))
    run_step(s)  # three decoding sequences from now on
    for c in ("c", "e"):  # the same 20 tokens, then the reply and a tool result: 26 tokens, 6 of them new
        s.add(seq(c + "2", n_prompt=26, first=seq(c).prompt_token_ids[0]))
    s.add(seq("long", n_prompt=40, max_tokens=2))
    step = run_step(s)[0]
    assert chunks(step) == {"d1": 1, "d2": 1, "d3": 1, "c2": 6, "e2": 6, "long": 8}
    assert dict(zip(step.seq_ids, step.num_computed))["c2"] == 20


def test_a_burst_of_long_prompts_beside_few_decodes_takes_large_chunks():
    """The long prompts' share grows with the long prompts per decoding sequence: 4 beside 1 take 4 x 8, and
    16 beside 1 would take more than the budget, so the limit is lifted."""
    for prompts, chunk in ((4, 32), (16, 63)):
        s = make(prefill_beside_decodes=8)
        s.add(seq("d", n_prompt=4, max_tokens=100))
        run_step(s)
        for j in range(prompts):
            s.add(seq(f"burst{prompts}-{j}", n_prompt=100, max_tokens=2))
        assert chunks(run_step(s)[0]) == {"d": 1, f"burst{prompts}-0": chunk}


def test_long_prompts_beside_32_streams_keep_every_step_even():
    """Workload L's second half: 32 streams decoding when 16 prompts of 2,048 tokens arrive (the CPU default
    limit, tokens weighed by their keys). Every step decodes all 32 streams, and the long prompts' chunks weigh
    the limit together in each (their last step aside), from the first chunk to the last."""
    from engine.scheduler.policy import _cost

    s = Scheduler(BlockManager(2400, 16), 64, 2048, 4096, prefill_beside_decodes=256)
    for i in range(32):
        s.add(seq(f"s{i}", n_prompt=20, max_tokens=2000))
    run_step(s)
    for j in range(16):
        s.add(seq(f"L{j}", n_prompt=2048, max_tokens=32))
    weights = []
    while any(q.seq_id.startswith("L") and q.num_computed < 2048 for q in [*s.running, *s.waiting]):
        step = run_step(s)[0]
        assert sum(sid.startswith("s") for sid in step.seq_ids) == 32
        weights.append(sum(_cost(c, n, s.prefill_keys_per_token)
                           for sid, c, n in zip(step.seq_ids, step.num_computed, step.num_new) if n > 1))
    assert max(weights) <= 256 + 5 and min(weights[:-1]) >= 240, (min(weights), max(weights))


def test_the_limit_lifts_once_nothing_decodes():
    s = make(prefill_beside_decodes=8)
    s.add(seq("d", n_prompt=4, max_tokens=2))
    run_step(s)
    s.add(seq("long", n_prompt=100, max_tokens=1))
    assert chunks(run_step(s)[0]) == {"d": 1, "long": 8}  # d samples its last token here
    assert chunks(run_step(s)[0]) == {"long": 64}


def test_without_the_limit_the_budget_alone_bounds_a_step():
    s = make()
    s.add(seq("d", n_prompt=4, max_tokens=100))
    run_step(s)
    s.add(seq("long", n_prompt=200, max_tokens=2))
    assert chunks(run_step(s)[0]) == {"d": 1, "long": 63}


def test_vllms_threshold_caps_each_request_unless_it_is_alone():
    s = make(long_prefill_token_threshold=10)
    s.add(seq("alone", n_prompt=100, max_tokens=1))
    assert chunks(run_step(s)[0]) == {"alone": 64}  # nobody to starve
    s.add(seq("b", n_prompt=30, max_tokens=1))
    assert chunks(run_step(s)[0]) == {"alone": 10, "b": 10}


def test_vllms_adaptive_threshold_floors_at_the_fair_share():
    s = make(long_prefill_token_threshold=10, long_prefill_adaptive=True)
    s.add(seq("a", n_prompt=100, max_tokens=1))
    s.add(seq("b", n_prompt=100, max_tokens=1))
    assert chunks(run_step(s)[0]) == {"a": 32, "b": 32}  # 64 // 2 requests > 10


def test_beside_decodes_a_chunk_late_in_a_long_prompt_is_shorter():
    """Tokens weigh 1 + their position / prefill_keys_per_token: with 100 per token and a limit of 20, the
    chunks shrink as the prompt's positions grow, and each weighs at most 20."""
    from engine.scheduler.policy import _cost

    s = make(budget=256, prefill_beside_decodes=20, prefill_keys_per_token=100)
    s.add(seq("d", n_prompt=4, max_tokens=1000))
    run_step(s)
    s.add(seq("long", n_prompt=200, max_tokens=2))
    sizes, start = [], 0
    while start < 200:
        n = chunks(run_step(s)[0]).get("long", 0)
        assert _cost(start, n, 100) <= 20 or n == 1
        sizes.append(n)
        start += n
    assert sizes[0] == 18 and sizes[-2] < 10 and sizes == sorted(sizes, reverse=True), sizes


def test_the_flags_default_by_device_and_a_negative_limit_is_refused_naming_it(capsys):
    from engine.config import parse_config
    from engine.config.scheduler import CPU_PREFILL_BESIDE_DECODES, prefill_beside_decodes

    cfg = parse_config([]).scheduler
    assert prefill_beside_decodes(cfg, "cpu") == CPU_PREFILL_BESIDE_DECODES
    assert prefill_beside_decodes(cfg, "cuda:0") == 0
    assert prefill_beside_decodes(parse_config(["--prefill-tokens-beside-decodes", "0"]).scheduler, "cpu") == 0
    with pytest.raises(SystemExit):
        parse_config(["--prefill-tokens-beside-decodes", "-5"])
    assert "--prefill-tokens-beside-decodes must be non-negative, got -5" in capsys.readouterr().err
