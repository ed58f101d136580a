"""Scheduler policy, driven by a fake "model" that samples a fixed token: no sockets, no tensors."""

import pytest

from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import SeqStatus, Sequence

pytestmark = pytest.mark.unit
_PROMPT_SLOT: dict[str, int] = {}  # seq id -> its own 100-token range above 100 (`first` prompts sit below)


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=128):
    from engine.scheduler import Scheduler

    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget, max_len)


def seq(sid, n_prompt=5, first=None, **sp):
    # distinct prompts per id unless `first` is given, so the prefix cache only hits where a test wants it
    # (a slot per id, not hash(): str hashes change per run and two ids could share a slot)
    start = first if first is not None else 101 + 100 * _PROMPT_SLOT.setdefault(sid, len(_PROMPT_SLOT))
    return Sequence(sid, list(range(start, start + n_prompt)), SamplingParams(**sp), eos_token_ids=[0])


def run_step(s, token=7):
    step = s.schedule()
    sampled = {}
    for q, n, before in zip(step.seqs, step.num_new, step.num_computed):
        if before + n == q.num_tokens:
            sampled[q.seq_id] = (token, -1.0, None)
    return step, s.update(step, sampled)


def test_requests_join_and_leave_the_running_batch_every_step():
    s = make()
    s.add(seq("a", max_tokens=2))
    step, ups = run_step(s)
    assert [q.seq_id for q in step.seqs] == ["a"] and step.num_new == [5]
    s.add(seq("b", max_tokens=3))
    step, ups = run_step(s)
    # a decodes (first), b prefills in the same step
    assert [q.seq_id for q in step.seqs] == ["a", "b"] and step.num_new == [1, 5]
    assert [u.finished for u in ups] == [True, False]  # a reached max_tokens=2
    step, _ = run_step(s)
    assert [q.seq_id for q in step.seqs] == ["b"]
    assert "a" in step.finished_ids


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=8)
    s.add(seq("long", n_prompt=20, max_tokens=1))
    s.add(seq("short", n_prompt=3, max_tokens=1))
    steps = []
    for _ in range(4):
        step, ups = run_step(s)
        steps.append((dict(zip([q.seq_id for q in step.seqs], step.num_new)), [u.seq.seq_id for u in ups]))
        assert step.num_tokens <= 8
    assert steps[0] == ({"long": 8}, [])
    assert steps[1] == ({"long": 8}, [])
    assert steps[2] == ({"long": 4, "short": 3}, ["long", "short"])


def test_preemption_by_recompute_when_blocks_run_out():
    # 7 blocks of 4 hold one 27-token sequence, not two: the later one is preempted and recomputed.
    s = make(num_blocks=7, block_size=4, budget=64)
    a, b = seq("a", n_prompt=7, max_tokens=20), seq("b", n_prompt=7, max_tokens=20)
    s.add(a)
    s.add(b)
    recompute = None
    for _ in range(200):
        if a.status is SeqStatus.FINISHED and b.status is SeqStatus.FINISHED:
            break
        known = b.num_tokens
        step, _ = run_step(s)
        assert sum(len(q.block_table) for q in s.running) <= 7
        if b.num_preemptions and b in step.seqs and recompute is None:
            i = step.seqs.index(b)
            recompute = (step.num_computed[i], step.num_new[i], known)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    computed, new, total = recompute
    assert computed + new == total and total > 7  # prompt and kept outputs recomputed, none regenerated
    assert len(a.output_token_ids) == len(b.output_token_ids) == 20


def test_stop_rules():
    s = make()
    e = seq("eos", max_tokens=10)
    s.add(e)
    _, ups = run_step(s, token=0)
    assert ups[0].finished and e.finish_reason == "stop"
    m = seq("min", max_tokens=10, min_tokens=2)
    s.add(m)
    _, ups = run_step(s, token=0)
    assert not ups[0].finished  # eos ignored below min_tokens (the worker masks it too)
    st = seq("stopid", max_tokens=10, stop_token_ids=[9])
    s.add(st)
    run_step(s, token=9)
    assert st.finish_reason == "stop" and st.stop_reason == 9
    ig = seq("ign", max_tokens=2, ignore_eos=True)
    s.add(ig)
    run_step(s, token=0)
    run_step(s, token=0)
    assert ig.finish_reason == "length"


def test_max_model_len_ends_with_length():
    s = make(max_len=8)
    q = seq("a", n_prompt=6, max_tokens=100)
    s.add(q)
    for _ in range(3):
        run_step(s)
    assert q.finish_reason == "length" and q.num_tokens == 8


def test_abort_frees_blocks_and_tells_workers():
    s = make()
    q = seq("a", max_tokens=100)
    s.add(q)
    run_step(s)
    free_before = s.blocks.num_free
    s.abort("a")
    assert q.finish_reason == "abort" and s.blocks.num_free > free_before
    step = s.schedule()
    assert step.finished_ids == ["a"] and not step.seqs


def test_max_num_seqs_caps_the_batch():
    s = make(max_seqs=2)
    for i in range(4):
        s.add(seq(f"r{i}", max_tokens=5))
    step, _ = run_step(s)
    assert len(step.seqs) == 2 and len(s.waiting) == 2


def test_prefix_cache_hit_skips_prompt_compute():
    s = make(block_size=4)
    a = seq("a", n_prompt=9, first=1, max_tokens=1)
    s.add(a)
    run_step(s)
    b = seq("b", n_prompt=9, first=1, max_tokens=1)
    s.add(b)
    step, _ = run_step(s)
    assert step.num_computed == [8] and step.num_new == [1] and b.num_cached_tokens == 8

    # vLLM: prompt logprobs need every prompt position computed, so that request skips the cache ...
    c = seq("c", n_prompt=9, first=1, max_tokens=1, prompt_logprobs=0)
    s.add(c)
    step, _ = run_step(s)
    assert step.num_computed == [0] and step.num_new == [9] and c.num_cached_tokens == 0
    # ... and its blocks are still shared with later requests
    d = seq("d", n_prompt=9, first=1, max_tokens=1)
    s.add(d)
    step, _ = run_step(s)
    assert step.num_computed == [8]


def test_the_prefix_cache_counters_count_a_prompt_once_when_it_is_admitted():
    """vLLM records a request's prefix-cache lookup when the scheduler admits it, not each step it is looked
    up and turned away for lack of blocks (vllm/v1/core/sched/scheduler.py record_prefix_cache_stats)."""
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(seq("warm", n_prompt=9, first=1, max_tokens=1))  # 3 blocks, the 2 full ones cached once it ends
    run_step(s)
    assert (s.blocks.num_prefix_queries, s.blocks.num_prefix_hits) == (2, 0)
    hog = seq("hog", n_prompt=9, max_tokens=3)  # the 3 never-used blocks, for 3 steps
    b = seq("b", n_prompt=17, first=1, max_tokens=1)  # warm's 2 cached blocks + 3 more: only 1 is free
    s.add(hog)
    s.add(b)
    turned_away = 0
    while b.status is SeqStatus.WAITING:
        step, _ = run_step(s)
        turned_away += b not in step.seqs
        assert turned_away < 10
    assert turned_away >= 2 and b.num_cached_tokens == 8
    assert (s.blocks.num_prefix_queries, s.blocks.num_prefix_hits) == (2 + 2 + 4, 2)  # warm, hog, b: (17-1)//4


def test_a_preempted_sequence_readmitted_is_not_counted_again():
    """vLLM counts a request readmitted after a preemption apart (PrefixCacheStats.preempted_*), not in
    vllm:prefix_cache_queries / hits: each prompt counts once, at its first admission."""
    s = make(num_blocks=7, block_size=4, budget=64)
    a, b = seq("a", n_prompt=9, max_tokens=20), seq("b", n_prompt=9, max_tokens=20)
    s.add(a)
    s.add(b)
    while a.status is not SeqStatus.FINISHED or b.status is not SeqStatus.FINISHED:
        run_step(s)
    assert b.num_preemptions >= 1
    assert (s.blocks.num_prefix_queries, s.blocks.num_prefix_hits) == (2 + 2, 0)


def test_a_sequence_preempted_during_a_step_keeps_the_sampled_token():
    s = make()
    q = seq("a", max_tokens=10)
    s.add(q)
    run_step(s)
    step = s.schedule()
    s._preempt(q)  # e.g. a pause that drops KV while the step runs
    s.update(step, {"a": (42, -1.0, None)})
    assert q.output_token_ids[-1] == 42 and q.num_computed == 0
    step = s.schedule()
    assert step.num_computed[0] + step.num_new[0] == q.num_tokens  # recompute (prefix cache helps), sample


def test_quiet_mechanics():
    """What a quiet does to the sequences (when to do it is engine.scheduler.step_gate's: tests/test_step_gate.py)."""
    s = make()
    for i in range(3):
        s.add(seq(f"r{i}", max_tokens=50))
    run_step(s)
    aborted = s.abort_all()
    assert len(aborted) == 3 and all(q.finish_reason == "abort" for q in aborted) and not s.has_work()
    a = seq("k", max_tokens=50)
    s.add(a)
    run_step(s)
    assert a.num_computed > 0
    s.drop_kv()
    assert a.num_computed == 0 and a.status is SeqStatus.WAITING  # KV dropped: recomputed on resume
    assert not s.blocks.cached  # the prefix cache forgot every hash


def test_reset_prefix_cache_fails_while_blocks_are_held_unless_running_requests_are_preempted():
    """vLLM's /reset_prefix_cache: False while a request holds KV; reset_running preempts (FIFO kept)."""
    s = make()
    s.add(seq("a", n_prompt=9, first=1, max_tokens=50))
    s.add(seq("b", n_prompt=9, first=100, max_tokens=50))
    run_step(s)
    assert not s.reset_prefix_cache(reset_running=False)
    assert s.blocks.cached  # nothing was forgotten
    assert s.reset_prefix_cache(reset_running=True)
    assert not s.blocks.cached and not s.running
    assert [q.seq_id for q in s.waiting] == ["a", "b"] and all(q.num_computed == 0 for q in s.waiting)
    run_step(s)  # recomputed, and their prompts are not found in the emptied cache
    assert s.blocks.num_prefix_hits == 0


def test_reset_prefix_cache_when_idle_forgets_finished_prompts():
    s = make()
    s.add(seq("a", n_prompt=9, first=1, max_tokens=1))
    run_step(s)
    assert not s.running and s.blocks.cached
    assert s.reset_prefix_cache(reset_running=False)
    s.add(seq("again", n_prompt=9, first=1, max_tokens=1))
    run_step(s)
    assert s.blocks.num_prefix_hits == 0


# --- --scheduling-policy priority (vLLM's) -----------------------------------------------------------------


def make_priority(**kw):
    s = make(**kw)
    s.policy = "priority"
    return s


def test_priority_admits_the_lowest_value_first_ties_by_arrival():
    s = make_priority(max_seqs=2, budget=64)
    for sid, prio, t in (("new-1", 5, 1.0), ("new-2", 5, 2.0), ("partial", -1, 3.0), ("mid", 0, 0.5)):
        q = seq(sid, priority=prio, max_tokens=50)
        q.arrival_time = t
        s.add(q)
    step, _ = run_step(s)
    assert [q.seq_id for q in step.seqs] == ["partial", "mid"]  # a resumed rollout (-1) ahead of everything
    assert [q.seq_id for q in s.waiting] == ["new-1", "new-2"]


def test_fcfs_ignores_priority():
    s = make(max_seqs=1)
    s.add(seq("first", priority=9))
    s.add(seq("second", priority=-9))
    step, _ = run_step(s)
    assert [q.seq_id for q in step.seqs] == ["first"]


def test_priority_preempts_the_highest_value_and_it_waits_in_its_place():
    # 7 blocks of 4 hold one 27-token sequence, not two: the one of lower priority (higher value) is preempted,
    # though it arrived first (fcfs would preempt the later one)
    s = make_priority(num_blocks=7, block_size=4, budget=64)
    low, high = seq("low", n_prompt=7, max_tokens=20, priority=10), seq("high", n_prompt=7, max_tokens=20, priority=1)
    low.arrival_time, high.arrival_time = 1.0, 2.0
    s.add(low)
    s.add(high)
    late = seq("late", n_prompt=3, max_tokens=1, priority=20)
    late.arrival_time = 0.5
    for _ in range(200):
        if high.status is SeqStatus.FINISHED:
            break
        run_step(s)
        if low.num_preemptions and late.seq_id not in s.seqs:
            s.add(late)  # waits behind `low` (priority 10 < 20) although it arrived earlier
            assert [q.seq_id for q in s.waiting][:2] == ["low", "late"] or low.status is SeqStatus.RUNNING
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert len(high.output_token_ids) == 20


# --- in-batch prefix sharing (--in-batch-prefix-sharing) ----------------------------------------------------

def sharing(**kw):
    s = make(**kw)
    s.in_batch_sharing = True
    return s


def test_in_batch_sharing_computes_a_prefix_shared_by_requests_sent_together_once():
    s = sharing(block_size=4)
    same = [seq(sid, n_prompt=9, first=1, max_tokens=2) for sid in "abcd"]
    other = seq("x", n_prompt=9, max_tokens=2)
    for q in [*same, other]:
        s.add(q)
    step, _ = run_step(s)
    # a computes the shared 8 tokens (two full blocks); b, c, d wait for them; x shares nothing and goes first
    assert dict(zip(step.seq_ids, step.num_new)) == {"a": 9, "x": 9}
    assert [q.seq_id for q in s.waiting] == ["b", "c", "d"]  # in their order
    step, _ = run_step(s)
    assert dict(zip(step.seq_ids, zip(step.num_computed, step.num_new))) == {
        "a": (9, 1), "x": (9, 1), "b": (8, 1), "c": (8, 1), "d": (8, 1)}
    assert [q.num_cached_tokens for q in same] == [0, 8, 8, 8]
    assert (s.blocks.num_prefix_hits, s.blocks.num_prefix_queries) == (6, 10)
    while s.has_work():
        run_step(s)
    assert all(q.finish_reason == "length" and len(q.output_token_ids) == 2 for q in [*same, other])


def test_without_in_batch_sharing_requests_sent_together_each_compute_their_prompt():
    s = make(block_size=4)
    for sid in "abc":
        s.add(seq(sid, n_prompt=9, first=1, max_tokens=1))
    step, _ = run_step(s)
    assert step.num_computed == [0, 0, 0] and step.num_new == [9, 9, 9]


def test_in_batch_sharing_waits_out_a_chunked_prefix_and_then_hits_all_of_it():
    # budget 8: the leader's 21-token prompt takes three steps; the follower waits while each of its next
    # blocks is being computed, then reuses all five full blocks
    s = sharing(block_size=4, budget=8)
    a, b = seq("a", n_prompt=21, first=1, max_tokens=1), seq("b", n_prompt=21, first=1, max_tokens=1)
    s.add(a)
    s.add(b)
    plans = []
    while s.has_work():
        step, _ = run_step(s)
        plans.append(dict(zip(step.seq_ids, zip(step.num_computed, step.num_new))))
    assert plans[:3] == [{"a": (0, 8)}, {"a": (8, 8)}, {"a": (16, 5)}]
    assert plans[3] == {"b": (20, 1)} and b.num_cached_tokens == 20


def test_in_batch_sharing_never_defers_prompt_logprobs_nor_a_prefix_no_one_computes():
    s = sharing(block_size=4)
    a = seq("a", n_prompt=9, first=1, max_tokens=1)
    lp = seq("lp", n_prompt=9, first=1, max_tokens=1, prompt_logprobs=0)  # never reads the cache
    short = seq("short", n_prompt=4, first=1, max_tokens=1)  # no full block before its last token
    for q in (a, lp, short):
        s.add(q)
    step, _ = run_step(s)
    assert step.seq_ids == ["a", "lp", "short"] and step.num_computed == [0, 0, 0]


def test_in_batch_sharing_does_not_defer_behind_a_leader_that_is_preempted_or_finished():
    s = sharing(block_size=4)
    a, b = seq("a", n_prompt=9, first=1, max_tokens=1), seq("b", n_prompt=9, first=1, max_tokens=1)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert step.seq_ids == ["a"]
    s.abort("a")  # aborted while its step computes: its blocks are never committed
    s.update(step, {})
    step, _ = run_step(s)
    assert step.seq_ids == ["b"] and step.num_computed == [0] and step.num_new == [9]


def test_in_batch_sharing_is_off_for_hybrid_models():
    from engine.scheduler import Scheduler
    from engine.state_checkpoints import StateCheckpoints

    s = Scheduler(BlockManager(64, 4, checkpoints=StateCheckpoints(4)), 8, 32, 128, state_slots=8)
    s.in_batch_sharing = True
    for sid in "ab":
        s.add(seq(sid, n_prompt=9, first=1, max_tokens=1))
    step, _ = run_step(s)
    assert sorted(step.seq_ids) == ["a", "b"]


def test_the_in_batch_sharing_flag_defaults_to_the_prefix_cache_and_is_refused_without_it():
    from engine.config import parse_config

    assert parse_config(["--model", "/m"]).cache.in_batch_prefix_sharing is None  # on: the cache is on
    assert parse_config(["--model", "/m", "--no-in-batch-prefix-sharing"]).cache.in_batch_prefix_sharing is False
    assert parse_config(["--model", "/m", "--no-enable-prefix-caching"]).cache.in_batch_prefix_sharing is None
    with pytest.raises(SystemExit, match="--no-enable-prefix-caching turns that cache off"):
        parse_config(["--model", "/m", "--in-batch-prefix-sharing", "--no-enable-prefix-caching"])
