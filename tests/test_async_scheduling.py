"""Async scheduling (--async-scheduling): the scheduler plans step N+1 while step N computes.

The policy half runs the scheduler against a fake worker that keeps its own copy of every sequence's tokens,
as a real worker does, and executes plans in order: each plan must only ask for positions the worker can
compute at that point (the tokens exist, the positions follow the last ones computed), and the outputs must
be exactly what the synchronous scheduler produces. The served half runs real processes with and without
the flag: the same seeded tokens and logprobs, EOS and stop strings still stop where they stop, exact
max_tokens counts, an abort pause mid-stream, and the workers no longer wait between steps."""

from __future__ import annotations

import collections
import concurrent.futures as cf

import httpx
import pytest

from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import SeqStatus, Sequence
from engine.scheduler.policy import Scheduler
from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.waits import wait_for

EOS = 0


def tok(sid: str, pos: int, eos_at: dict[str, int]) -> int:
    """The fake model's token at `pos`: EOS at the position a test chose, else a token of the sequence's own."""
    return EOS if eos_at.get(sid) == pos else 1000 + pos


class FakeWorker:
    """Runs plans in order against its own token lists; raises if a plan asks for what it cannot compute."""

    def __init__(self, eos_at: dict[str, int]):
        self.tokens: dict[str, int] = {}  # seq id -> tokens it knows (prompt + sampled)
        self.computed: dict[str, int] = {}
        self.eos_at = eos_at

    def run(self, step) -> dict[str, tuple[int, float, None]]:
        for s in step.new_seqs:
            self.tokens[s.seq_id] = len(s.prompt_token_ids)
            self.computed[s.seq_id] = 0
        for sid in step.finished_ids:
            self.tokens.pop(sid, None)
        sampled = {}
        for q, n, start in zip(step.seqs, step.num_new, step.num_computed):
            sid = q.seq_id
            # never a gap: positions start from where it computed to, or earlier (a recompute, whose prefix may
            # come from the prefix cache)
            assert start <= self.computed[sid] or q.num_preemptions == 0 and start < len(q.prompt_token_ids), sid
            assert start + n <= self.tokens[sid], f"{sid}: plan asks for position {start + n - 1}, worker has " \
                                                  f"{self.tokens[sid]} tokens"
            self.computed[sid] = start + n
            if start + n == self.tokens[sid]:
                sampled[sid] = (tok(sid, self.tokens[sid], self.eos_at), -1.0, None)
                self.tokens[sid] += 1
        return sampled


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=128) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget, max_len)


def seqs(specs: dict[str, dict]) -> list[Sequence]:
    out = []
    for i, (sid, sp) in enumerate(specs.items()):
        n_prompt = sp.pop("n_prompt", 5)
        out.append(Sequence(sid, list(range(100 * (i + 1), 100 * (i + 1) + n_prompt)), SamplingParams(**sp),
                            eos_token_ids=[EOS]))
    return out


def drive(s: Scheduler, all_seqs: list[Sequence], eos_at: dict[str, int], depth: int, arrivals=None,
          abort_at: dict[int, str] | None = None, max_steps: int = 500):
    """Plan up to `depth` steps ahead, apply results oldest first. Returns (outputs per seq, steps run,
    the fake worker)."""
    arrivals = arrivals or {0: all_seqs}
    worker = FakeWorker(eos_at)
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    in_flight: collections.deque = collections.deque()
    steps = 0
    for tick in range(max_steps):
        for q in arrivals.get(tick, ()):
            s.add(q)
        if abort_at and tick in abort_at:
            s.abort(abort_at[tick])
        while len(in_flight) < depth and s.has_work():
            step = s.schedule()
            if not step.seqs:
                break
            in_flight.append(step)
        if not in_flight:
            if not s.has_work() and tick > max(arrivals):
                break
            continue
        step = in_flight.popleft()
        steps += 1
        for u in s.update(step, worker.run(step)):
            outputs[u.seq.seq_id].append(u.token_id)
    assert not in_flight and not s.has_work()
    return outputs, steps, worker


SPECS = {"a": {"max_tokens": 6}, "b": {"max_tokens": 9, "n_prompt": 11}, "e": {"max_tokens": 20},
         "m": {"max_tokens": 5, "min_tokens": 3}, "long": {"max_tokens": 3, "n_prompt": 45}}
EOS_AT = {"e": 9, "m": 7}  # e stops at EOS after 4 tokens; m samples EOS at its first output


@pytest.mark.unit
@pytest.mark.parametrize("budget", [32, 8])
def test_planning_ahead_gives_the_synchronous_outputs(budget: int) -> None:
    sync_out, sync_steps, _ = drive(make(budget=budget), seqs({k: dict(v) for k, v in SPECS.items()}), EOS_AT, 1)
    s = make(budget=budget)
    out, steps, worker = drive(s, seqs({k: dict(v) for k, v in SPECS.items()}), EOS_AT, 2)
    assert out == sync_out
    assert [len(out[k]) for k in ("a", "b", "long")] == [6, 9, 3]  # exact max_tokens: no token past them
    assert out["e"][-1] == EOS and len(out["e"]) == 5
    assert s.blocks.num_free == s.blocks.num_blocks  # every block came back
    assert steps <= sync_steps + 2  # the extra steps are the EOS stoppers' dropped tokens only


@pytest.mark.unit
@pytest.mark.parametrize("depth", [1, 2])
def test_in_batch_sharing_planning_ahead_waits_for_the_leaders_blocks(depth: int) -> None:
    """--in-batch-prefix-sharing with a step in flight: the followers of a prompt wait until the leader's blocks
    are committed (not merely planned), then hit them; the outputs are the synchronous, unshared ones."""
    def group() -> list[Sequence]:
        same = [Sequence(f"g{i}", list(range(500, 509)), SamplingParams(max_tokens=4), eos_token_ids=[EOS])
                for i in range(4)]
        return same + seqs({"a": {"max_tokens": 6}, "b": {"max_tokens": 5, "n_prompt": 11}})

    sync_out, _, _ = drive(make(), group(), {}, 1)
    s = make()
    s.in_batch_sharing = True
    all_seqs = group()
    out, _, _ = drive(s, all_seqs, {}, depth)
    assert out == sync_out
    assert [q.num_cached_tokens for q in all_seqs[:4]] == [0, 8, 8, 8]
    assert s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.unit
def test_a_sequence_finishing_at_max_tokens_is_not_planned_again() -> None:
    s = make()
    (a,) = seqs({"a": {"max_tokens": 1}})
    s.add(a)
    first = s.schedule()
    assert first.seq_ids == ["a"] and a.inflight_samples == 1
    ahead = s.schedule()  # its one token is in flight: nothing left to plan
    assert ahead.seqs == []


@pytest.mark.unit
def test_an_eos_stopper_computes_one_dropped_token() -> None:
    s = make()
    (e,) = seqs({"e": {"max_tokens": 50}})
    s.add(e)
    worker = FakeWorker({"e": 5})  # EOS is the first token
    first, ahead = s.schedule(), s.schedule()
    assert ahead.seq_ids == ["e"] and ahead.num_computed == [5]  # decodes the token being sampled now
    ups = s.update(first, worker.run(first))
    assert [u.token_id for u in ups] == [EOS] and ups[0].finished
    assert s.update(ahead, worker.run(ahead)) == []  # the extra token is dropped
    nxt = s.schedule()
    assert nxt.seqs == [] and nxt.finished_ids == ["e"]
    assert e.status is SeqStatus.FINISHED and e.output_token_ids == [EOS]


@pytest.mark.unit
def test_preemption_while_two_steps_are_in_flight() -> None:
    # 9 blocks of 4 cannot hold both 30-token sequences: the later is preempted (maybe while a step of it
    # computes) and recomputed; the worker still never gets a plan it cannot run.
    specs = {"p": {"max_tokens": 25, "n_prompt": 7}, "q": {"max_tokens": 25, "n_prompt": 7}}
    sync_out, _, _ = drive(make(num_blocks=9), seqs({k: dict(v) for k, v in specs.items()}), {}, 1)
    s = make(num_blocks=9)
    out, _, _ = drive(s, seqs({k: dict(v) for k, v in specs.items()}), {}, 2)
    assert s.num_preemptions >= 1
    assert out == sync_out and all(len(v) == 25 for v in out.values())
    assert s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.unit
def test_aborts_and_late_arrivals_with_a_step_in_flight() -> None:
    specs = {"a": {"max_tokens": 30}, "b": {"max_tokens": 30}, "c": {"max_tokens": 4}}
    all_seqs = seqs(specs)
    s = make()
    out, _, _ = drive(s, all_seqs, {}, 2, arrivals={0: all_seqs[:2], 5: all_seqs[2:]}, abort_at={8: "a"})
    assert 0 < len(out["a"]) < 30 and all_seqs[0].finish_reason == "abort"
    assert len(out["b"]) == 30 and len(out["c"]) == 4
    assert s.blocks.num_free == s.blocks.num_blocks


# --- the worker: a failed step's sequences are skipped by the plan sent after it ---------------------------

@pytest.mark.unit
def test_a_plan_after_a_failed_step_runs_without_its_sequences(tmp_path) -> None:
    import torch

    from bus.messages import NewSeq, StepPlan
    from tests.tiny_models import load_model, make_tiny_checkpoint
    from workers.kv_cache import KVCache
    from workers.model_runner import ModelRunner

    model = load_model(make_tiny_checkpoint("qwen3", tmp_path / "m"))
    kv = KVCache(*model.kv_spec, 4, 16, torch.float32, torch.device("cpu"))
    r = ModelRunner(model, kv, rank=0, block_size=4, device=torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    r.execute(StepPlan(1, [NewSeq("a", [1, 2, 3], greedy, []), NewSeq("b", [4, 5, 6], greedy, [])],
                       ["a", "b"], [0, 0], [3, 3], [[0], [4]], [], 0))
    # step 2 raised on this worker (the actor drops its sequences); step 3 was planned before the scheduler
    # knew, and still names "a" at a position this worker never sampled
    r.drop(["a"])
    res = r.execute(StepPlan(3, [], ["a", "b"], [4, 3], [1, 1], [[0, 1], [4]], [], 0))
    assert res.seq_ids == ["b"] and res.token_ids.shape == (1,)
    assert [(sid, e.kind) for sid, e in res.seq_errors] == [("a", "StepFailed")]
    # the finished list that follows frees the id for a new request of the same name
    res = r.execute(StepPlan(4, [NewSeq("a", [7, 8], greedy, [])], ["a"], [0], [2], [[2]], ["a"], 0))
    assert res.seq_ids == ["a"] and res.seq_errors == [] and not r.dropped


# --- served: real processes, with and without the flag ------------------------------------------------------

MODEL = "async-tiny"
# batch-invariant kernels: the two servers batch the same requests differently (the async one computes the
# EOS stoppers' extra token, and starts requests a step later), and only then are logprobs equal bit for bit
RL = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_dir):  # noqa: F811
    work = tmp_path_factory.mktemp("async")
    folder = tiny_model_with_tokenizer("qwen3", work / "m", smollm2_dir, vocab_size=49152,
                                       max_position_embeddings=1024)
    flags = ("--served-model-name", MODEL, "--additional-config", RL, "--max-model-len", "1024",
             "--max-num-batched-tokens", "64", "--max-logprobs", "5")
    for name in ("sync", "async"):
        (work / name).mkdir()
    with cf.ThreadPoolExecutor(2) as ex:
        started = [ex.submit(start_server, work / name, str(folder), *flags, flag)
                   for name, flag in (("sync", "--no-async-scheduling"), ("async", "--async-scheduling"))]
        pair = [f.result() for f in started]
    yield dict(zip(("sync", "async"), pair))
    for s in pair:
        s.stop()


def complete(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def probe(url: str, prompt: str, n: int) -> list[int]:
    """The greedy continuation's token ids (to pick stop tokens and strings that surely occur)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    return complete(url, body)["choices"][0]["token_ids"]


def bodies(url: str) -> list[dict]:
    stop_tok = probe(url, "Stop token test", 40)[6]
    text = complete(url, {"prompt": "Stop string test", "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    stop_str = text["choices"][0]["text"][10:14]
    out = []
    for i in range(12):
        kind = i % 4
        b = {"prompt": f"Request {i} says", "max_tokens": 30 + i, "logprobs": 2, "return_token_ids": True}
        if kind == 0:
            b |= {"temperature": 1.0, "seed": i, "n": 2, "ignore_eos": True}
        elif kind == 1:
            b |= {"temperature": 0, "stop_token_ids": [stop_tok], "prompt": "Stop token test"}
        elif kind == 2:
            b |= {"temperature": 0.8, "seed": 100 + i, "stop": [stop_str], "prompt": "Stop string test"}
        else:
            b |= {"temperature": 0, "prompt_logprobs": 1, "min_tokens": 3}
        out.append(b)
    return out


def answers(url: str, reqs: list[dict]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(reqs)) as ex:
        outs = list(ex.map(lambda b: complete(url, b), reqs))
    keep = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs")
    return [[{k: c.get(k) for k in keep} for c in o["choices"]] + [o["usage"]] for o in outs]


@pytest.mark.timeout(600)
def test_the_same_outputs_with_and_without_async_scheduling(servers) -> None:
    reqs = bodies(servers["sync"].url)
    want = answers(servers["sync"].url, reqs)
    got = answers(servers["async"].url, reqs)
    assert got == want
    reasons = {c["finish_reason"] for o in want for c in o[:-1]}
    assert reasons == {"length", "stop"}
    stopped = [o for o, b in zip(want, reqs) if "stop_token_ids" in b]
    assert all(o[0]["finish_reason"] == "stop" and o[0]["stop_reason"] == b["stop_token_ids"][0]
               for o, b in zip(stopped, [b for b in reqs if "stop_token_ids" in b]))
    assert all(o[-1]["completion_tokens"] == b["max_tokens"] * b.get("n", 1)
               for o, b in zip(want, reqs) if b.get("ignore_eos"))


def test_the_workers_do_not_wait_between_steps(servers) -> None:
    """The scheduler counts a turnaround whenever the workers sat idle between a step's results and the next
    plan. Synchronous: once per step. Async: only when there was nothing to plan ahead (a batch's start)."""
    counts = {}
    for name, s in servers.items():
        before = (metric(s, "rollbus_turnarounds"), metric(s, "rollbus_step_latency_seconds_count"))
        complete(s.url, {"prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True, "n": 4, "temperature": 1.0})
        counts[name] = (metric(s, "rollbus_turnarounds") - before[0],
                        metric(s, "rollbus_step_latency_seconds_count") - before[1])
    sync_waits, sync_steps = counts["sync"]
    async_waits, async_steps = counts["async"]
    assert sync_steps >= 120 and sync_waits >= sync_steps - 2
    assert async_steps >= 120 and async_waits <= 2, counts
    info = httpx.get(servers["async"].url + "/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["scheduler_config"]["async_scheduling"] is True


def test_an_abort_pause_with_two_steps_in_flight(servers) -> None:
    url = servers["async"].url
    done: dict[int, dict] = {}

    def go(i):
        done[i] = complete(url, {"prompt": f"Long {i}", "max_tokens": 900, "ignore_eos": True, "temperature": 0})

    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(go, i) for i in range(3)]
        base = metric(servers["async"], "rollbus_engine_generation_tokens_total")
        wait_for(lambda: metric(servers["async"], "rollbus_engine_generation_tokens_total") >= base + 30, 60,
                 "tokens sampled")
        r = httpx.post(url + "/pause", params={"mode": "abort"}, timeout=60)
        assert r.status_code == 200
        for f in futs:
            f.result(timeout=120)
    assert {d["choices"][0]["finish_reason"] for d in done.values()} == {"abort"}
    assert all(0 < d["usage"]["completion_tokens"] < 900 for d in done.values())
    assert httpx.post(url + "/resume", timeout=60).status_code == 200
    # the engine goes on, and the next request's answer is the synchronous server's
    body = {"prompt": "After the pause", "max_tokens": 20, "temperature": 0, "logprobs": 1}
    assert answers(url, [body]) == answers(servers["sync"].url, [body])
