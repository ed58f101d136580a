"""The scheduler's two limits on prefill chunks (engine/scheduler/chunk_limits.py, applied by
engine/scheduler/policy.py): a step's prefill tokens while anything decodes (--prefill-tokens-beside-decodes), and
vLLM's per-request --long-prefill-token-threshold."""

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from tests.test_scheduler import run_step, seq

pytestmark = pytest.mark.unit


def make(budget=64, **limits):
    limits.setdefault("prefill_keys_per_token", 0)  # tokens unweighed by their keys, but in the last test
    limits.setdefault("prefill_beside_streams", 1)  # the limit as given from one decoding stream on, but where scaled
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


def test_fewer_decoding_streams_than_s_share_s_streams_wait_in_larger_chunks():
    """With S = 4 streams at which the limit of 8 holds: beside 1 decoding stream the first long prompt's chunk may
    take 8 x 4 = 32 tokens of a step, beside 2 16, beside 3 10 (8 x 4 // 3), beside 4 or more 8; never more than
    the budget. Only the first long prompt takes the larger share; the next gets what is left of the 8."""
    s = make(prefill_beside_decodes=8, prefill_beside_streams=4)
    s.add(seq("d1", n_prompt=4, max_tokens=100))
    run_step(s)
    s.add(seq("long", n_prompt=1000, max_tokens=2))
    got = []
    for d in range(1, 6):
        step = chunks(run_step(s)[0])
        assert sorted(k for k, n in step.items() if n == 1) == [f"d{i}" for i in range(1, d + 1)], step
        got.append(step["long"])
        s.add(seq(f"d{d + 1}", n_prompt=4, max_tokens=100))
        run_step(s)  # its short prompt comes in whole; it decodes from the next step on
    assert got == [32, 16, 10, 8, 8]
    s.add(seq("next", n_prompt=1000, max_tokens=2))  # a second long prompt: the larger share is the first one's
    step = chunks(run_step(s)[0])
    assert step["long"] == 8 and "next" not in step, step  # 6 decoding: 8 x 4 // 6 < 8, so N; nothing left
    for i in range(2, 7):
        s.abort(f"d{i}")
    step = chunks(run_step(s)[0])  # 1 decoding again: long takes 32, next gets nothing of N's 8
    assert step == {"d1": 1, "long": 32}, step
    wide = make(prefill_beside_decodes=8, prefill_beside_streams=100)
    wide.add(seq("d", n_prompt=4, max_tokens=100))
    run_step(wide)
    wide.add(seq("long", n_prompt=1000, max_tokens=2))
    assert chunks(run_step(wide)[0]) == {"d": 1, "long": 63}  # 8 x 100 capped at the budget, less d's token


def test_a_long_prompt_after_the_first_gets_what_the_first_left_of_n():
    """Beside 1 decoding stream (S = 4, N = 8): the first long prompt, 5 tokens from its end, weighs 5, so the
    second long prompt gets the 3 left of N, not the larger share."""
    s = make(prefill_beside_decodes=8, prefill_beside_streams=4)
    s.add(seq("d", n_prompt=4, max_tokens=100))
    run_step(s)
    s.add(seq("a", n_prompt=37, max_tokens=2))
    s.add(seq("b", n_prompt=100, max_tokens=2))
    assert chunks(run_step(s)[0]) == {"d": 1, "a": 32}
    assert chunks(run_step(s)[0]) == {"d": 1, "a": 5, "b": 3}
    assert chunks(run_step(s)[0]) == {"d": 1, "a": 1, "b": 16}  # a decodes too: 2 decoding, 8 x 4 // 2


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
    from engine.scheduler.chunk_limits import cost

    s = make(budget=256, prefill_beside_decodes=20, prefill_keys_per_token=100)
    s.add(seq("d", n_prompt=4, max_tokens=1000))
    run_step(s)
    s.add(seq("long", n_prompt=200, max_tokens=2))
    sizes, start = [], 0
    while start < 200:
        n = chunks(run_step(s)[0]).get("long", 0)
        assert cost(start, n, 100) <= 20 or n == 1
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
