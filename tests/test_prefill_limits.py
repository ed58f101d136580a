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
    run_step(s)  # d's prompt: it decodes from now on
    s.add(seq("long", n_prompt=14, max_tokens=2))
    s.add(seq("long2", n_prompt=12, max_tokens=2))
    s.add(seq("short", n_prompt=5, max_tokens=2))
    got = [chunks(run_step(s)[0]) for _ in range(4)]
    assert got == [{"d": 1, "long": 8},  # long2 waits: the long prompts' 8 are spent (and short behind it)
                   {"d": 1, "long": 6, "long2": 2, "short": 5},  # long's last 6 and long2's first 2
                   {"d": 1, "long": 1, "short": 1, "long2": 8},
                   {"d": 1, "long2": 2}]  # long and short reached max_tokens=2


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
