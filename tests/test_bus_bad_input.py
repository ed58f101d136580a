"""Bad input on the bus: malformed frames, unknown kinds, wrong field types and truncated array frames
sent to every bound socket of a running engine (coordinator ROUTER and XPUB, scheduler ROUTER, XPUB and
PULL) are logged and dropped; no process dies and no request is lost. The SUB side (what a member reads
from the coordinator) is fed the same garbage by a fake coordinator, and a real worker process's plan and
abort-watch SUBs by a fake coordinator and a fake scheduler around it. Well-typed step results that do not
fit the step in flight are dropped too. Real processes, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from bus.codec import decode, encode
from bus.endpoints import COMMAND_TOPIC, PLAN_TOPIC, Endpoints
from bus.messages import (
    Ack,
    AddRequest,
    Command,
    ControlRequest,
    ControlState,
    Health,
    Hello,
    MemberLost,
    NewSeq,
    OutputBatch,
    PromptLogprobs,
    StepPlan,
    StepResult,
    Welcome,
)
from bus.sockets import make_socket, send
from tests.bus_helpers import MemberThread, bus_config, wait_for
from tests.server_helpers import start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(240)


def _raw(kind: int, body) -> list[bytes]:
    return [bytes([kind]) + msgspec.msgpack.encode(body)]


def garbage() -> list[tuple[str, list[bytes]]]:
    res = [bytes(f) for f in encode(StepResult(1, 0, ["x"], np.arange(8), np.zeros(8, np.float32),
                                               np.zeros((8, 2), np.int64), np.zeros((8, 2), np.float32), 0))]
    missing_frame = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([3, "np:<i8", [2]]))
    return [
        ("empty frame", [b""]),
        ("unknown kind", [b"\xfe" + b"whatever"]),
        ("malformed msgpack", [bytes([AddRequest.KIND]) + b"\xc1\xc1"]),
        ("not an array body", _raw(AddRequest.KIND, {"request_id": "r"})),
        ("wrong field type", _raw(AddRequest.KIND, ["bad-1", "not a list", [], [0], 1.0])),
        ("sampling params as a dict", _raw(AddRequest.KIND, ["bad-2", [1, 2], {"max_tokens": 3}, [0], 1.0])),
        ("unknown field", _raw(Hello.KIND, ["worker", "x", 1, 6, {}, "", "surplus"])),
        ("missing field", _raw(Ack.KIND, [1])),
        ("unknown command", _raw(ControlRequest.KIND, ["r", ["no_such_command"], 1.0])),
        ("command field of the wrong type", _raw(ControlRequest.KIND, ["r", ["pause", 3, True], 1.0])),
        ("truncated array frame", [res[0], res[1][:-5], *res[2:]]),
        ("array frame longer than its shape", [res[0], res[1] + b"\0" * 8, *res[2:]]),
        ("object dtype array", [bytes([StepResult.KIND]) + msgspec.msgpack.encode(
            [1, 0, [], msgspec.msgpack.Ext(1, msgspec.msgpack.encode([1, "np:|O", [2]])), None, None, None, 0]),
            b"\0" * 16]),
        ("array frame missing", res[:2]),
        ("array header naming no frame", [bytes([StepResult.KIND]) + msgspec.msgpack.encode(
            [1, 0, [], missing_frame, None, None, None, 0])]),
        ("int where an array must be", _raw(StepResult.KIND, [1, 0, ["x"], 7, None, None, None, 0])),
        ("a multi-frame mess", [b"\x01", b"\x02", b"\x03" * 1000]),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("badbus")
    folder = tiny_model_with_tokenizer("llama", tmp / "llama", smollm2_dir)
    s = start_server(tmp, str(folder), "--served-model-name", "tiny", "--max-model-len", "256")
    s.vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    yield s
    s.stop()


def test_garbage_on_every_bound_socket_is_dropped(server):
    ep = Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}")
    pids = server.child_pids()
    assert {"coordinator", "scheduler", "worker-0", "gateway"} <= set(pids), pids
    result: dict = {}

    def long_request() -> None:  # running while the garbage arrives: it must finish, whole
        with httpx.Client(base_url=server.url, timeout=120) as h:
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 120,
                                                "ignore_eos": True})
            result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    t.start()
    ctx = zmq.Context()
    try:
        targets = [  # (socket type to connect, endpoint, who binds it)
            (zmq.DEALER, ep.control, "coordinator ROUTER"),
            (zmq.DEALER, ep.requests, "scheduler ROUTER"),
            (zmq.PUSH, ep.results, "scheduler PULL"),
            (zmq.XSUB, ep.commands, "coordinator XPUB"),
            (zmq.XSUB, ep.plans, "scheduler XPUB"),
        ]
        for kind, endpoint, _ in targets:
            sock = make_socket(ctx, kind, connect=endpoint, identity="rogue" if kind == zmq.DEALER else None)
            for _, frames in garbage():
                sock.send_multipart(frames)
            if kind == zmq.XSUB:
                # not a (un)subscription, but it ends in a member's presence topic: it must not read as
                # worker-0 leaving (that would fail every request)
                for frame in (b"\x02@worker-0", b"\x00@worker-0", b"\x01@\xff\xfe", b"\x01"):
                    sock.send(frame)
            sock.close(linger=2000)
        t.join(150)
        assert not t.is_alive(), "the running request never finished"
        assert result["status"] == 200, result
        assert result["body"]["usage"]["completion_tokens"] == 120  # nothing lost, nothing cut short
        wait_for(lambda: all(w in server.log() for w in ("coordinator.bad_message", "scheduler.bad_message",
                                                       "scheduler.bad_result")), 20, "the drops to be logged")
        with httpx.Client(base_url=server.url, timeout=60) as h:
            assert h.get("/health").status_code == 200
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": [4, 5], "max_tokens": 4,
                                                "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert server.proc.poll() is None and server.child_pids() == pids  # nobody died or restarted
        assert "member_lost" not in server.log()
    finally:
        ctx.destroy(linger=0)
        t.join(10)


def bad_add_requests(vocab: int) -> dict[str, tuple[AddRequest, str]]:
    """AddRequests that are well-typed but that no worker may see, each with the field its error must name."""
    from bus.sampling_params import SamplingParams

    def add(rid, prompt=(1, 2, 3), eos=(0,), **sp) -> AddRequest:
        return AddRequest(rid, list(prompt), SamplingParams(**{"max_tokens": 4, **sp}), list(eos), time.time())

    cases = {
        "bad-vocab": (add("bad-vocab", prompt=(1, vocab)), "prompt_token_ids"),
        "bad-negative": (add("bad-negative", prompt=(-1, 2)), "prompt_token_ids"),
        "bad-empty": (add("bad-empty", prompt=()), "prompt_token_ids"),
        "bad-long": (add("bad-long", prompt=[1] * 300), "prompt_token_ids"),
        "bad-eos": (add("bad-eos", eos=(vocab + 5,)), "eos_token_ids"),
        "bad-stop-id": (add("bad-stop-id", stop_token_ids=[vocab], min_tokens=2), "sampling.stop_token_ids"),
        "bad-max-tokens-0": (add("bad-max-tokens-0", max_tokens=0), "sampling.max_tokens"),
        "bad-max-tokens-huge": (add("bad-max-tokens-huge", max_tokens=2**62), "sampling.max_tokens"),
        "bad-n": (add("bad-n", n=0), "sampling.n"),
        "bad-logprobs": (add("bad-logprobs", logprobs=10**6), "sampling.logprobs"),
        "bad-prompt-logprobs": (add("bad-prompt-logprobs", prompt_logprobs=-5), "sampling.prompt_logprobs"),
        "bad-temperature": (add("bad-temperature", temperature=math.nan), "sampling.temperature"),
        "bad-top-p": (add("bad-top-p", top_p=math.inf), "sampling.top_p"),
        "bad-top-k": (add("bad-top-k", top_k=-7), "sampling.top_k"),
        "bad-penalty": (add("bad-penalty", repetition_penalty=-1.0), "sampling.repetition_penalty"),
        "bad-trace": (add("bad-trace", trace_decode_token_ids=[1]), "sampling.trace_decode_token_ids"),
    }
    return cases


def test_bad_add_requests_on_the_bus_are_refused_before_any_worker_sees_them(server):
    """Well-typed AddRequests straight on the scheduler's ROUTER (no gateway in front) with prompt ids outside
    the vocabulary, an empty or too long prompt, out-of-range sampling values: each is answered to its sender
    with a finished output carrying an ErrorInfo that names the field; good requests sent in the same burst,
    before and after them, complete whole; no step fails and nobody dies."""
    from bus.sampling_params import SamplingParams

    ep = Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}")
    pids = server.child_pids()
    bad = bad_add_requests(server.vocab_size)
    good = {f"good-{i}": AddRequest(f"good-{i}", [5, 6, 7, 8], SamplingParams(max_tokens=24, ignore_eos=True,
                                                                            temperature=0.0), [0], time.time())
            for i in range(2)}
    ctx = zmq.Context()
    try:
        dealer = make_socket(ctx, zmq.DEALER, connect=ep.requests, identity="raw-client")
        send(dealer, good["good-0"])
        for req, _ in bad.values():
            send(dealer, req)
        send(dealer, good["good-1"])
        outs: dict[str, list] = {}
        deadline = time.monotonic() + 120
        while not all(outs.get(r) and outs[r][-1].finished for r in [*bad, *good]):
            assert time.monotonic() < deadline, sorted(r for r in [*bad, *good] if not (outs.get(r) or [None])[-1])
            if dealer.poll(200):
                batch = decode(dealer.recv_multipart())
                assert isinstance(batch, OutputBatch)
                for o in batch.outputs:
                    outs.setdefault(o.request_id, []).append(o)
        for rid, (_, param) in bad.items():
            (o,) = outs[rid]  # one answer, at once, with no tokens
            assert o.finish_reason == "error" and o.token_ids == [] and o.error is not None, (rid, o)
            assert o.error.param == param and o.error.status == 400, (rid, o.error)
        for rid in good:
            o = outs[rid]
            assert [x.error for x in o] == [None] * len(o), o
            assert sum(len(x.token_ids) for x in o) == 24 and o[-1].finish_reason == "length", (rid, o[-1])
        toks = [[t for x in outs[r] for t in x.token_ids] for r in good]
        assert toks[0] == toks[1]  # the same greedy prompt: batched with the bad ones, nothing disturbed it
        with httpx.Client(base_url=server.url, timeout=60) as h:
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        log = server.log()
        assert "StepFailed" not in log and "Traceback" not in log
        assert server.proc.poll() is None and server.child_pids() == pids
    finally:
        ctx.destroy(linger=0)


def test_frames_above_the_limit_are_dropped_on_every_bound_socket(server):
    """One frame just above each bound socket's limit (bus.frame_limits: a multi-MB AddRequest, a StepResult
    with a huge array frame, a ControlRequest, a subscription): libzmq drops it unread and disconnects the
    sender, the process logs the disconnect and nobody dies. Had a frame come through, the AddRequest would
    have run and the ControlRequest been answered: neither is."""
    from bus.frame_limits import limits_for
    from bus.sampling_params import SamplingParams
    from engine.config import EngineConfig

    ep = Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}")
    limits = limits_for(EngineConfig.from_flags(max_model_len=256))  # the module's server
    pids = server.child_pids()
    seen = len(server.log())
    big = {name: limits[name] + (1 << 20) for name in limits}
    ctx = zmq.Context()
    try:
        dealer = make_socket(ctx, zmq.DEALER, connect=ep.requests, identity="huge-client")
        send(dealer, AddRequest("r" * big["requests"], [1, 2, 3], SamplingParams(max_tokens=2), [0], time.time()))
        push = make_socket(ctx, zmq.PUSH, connect=ep.results)
        n = big["results"] // 8
        send(push, StepResult(10**6, 0, ["x"], np.zeros(n, np.int64), np.zeros(1, np.float32),
                              np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32), 0))
        control = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="huge-trainer")
        send(control, ControlRequest("c" * big["control"], Health(), 5.0))
        for endpoint in (ep.plans, ep.commands):
            xsub = make_socket(ctx, zmq.XSUB, connect=endpoint)
            # not a subscription (\x01): an XSUB keeps those and sends them again on every reconnect
            xsub.send(b"\x02@" + b"x" * big["plans"])
        for name, endpoint in (("requests", ep.requests), ("results", ep.results), ("control", ep.control),
                               ("plans", ep.plans), ("commands", ep.commands)):
            wait_for(lambda: any("bus.peer_disconnected" in line and endpoint in line
                                 for line in server.log()[seen:].splitlines()), 30, f"the {name} drop to be logged")
        assert not dealer.poll(1000) and not control.poll(100)  # neither message was read
        with httpx.Client(base_url=server.url, timeout=60) as h:
            assert h.get("/health").status_code == 200
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": [4, 5], "max_tokens": 4,
                                                "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert server.proc.poll() is None and server.child_pids() == pids
        assert "member_lost" not in server.log()
    finally:
        ctx.destroy(linger=0)


def wrong_results(plan: StepPlan) -> list[StepResult]:
    """Well-formed StepResults for the step in flight that do not fit it."""
    ids, n = plan.seq_ids, len(plan.seq_ids)

    def res(seq_ids=ids, rank=0, rows=n, **kw) -> StepResult:
        return StepResult(plan.step_id, rank, list(seq_ids), kw.pop("token_ids", np.arange(rows)),
                          np.zeros(rows, np.float32), kw.pop("topk_ids", np.zeros((rows, 2), np.int64)),
                          np.zeros((rows, 2), np.float32), plan.weight_epoch, **kw)

    lp = PromptLogprobs("nope", np.zeros(2, np.float32), np.ones(2, np.int64), np.zeros((2, 1), np.int64),
                        np.zeros((2, 1), np.float32))
    return [
        res(rank=7),  # a rank that does not exist
        res(rank=-1),
        res([*ids, "nope"], rows=n + 1),  # a sequence the step did not run
        res(rows=n + 3),  # arrays longer than the sequences
        res(rows=max(n - 1, 0)) if n else res(["nope"], rows=0),  # ... or shorter
        res(token_ids=np.zeros((n, 1), np.int64)),  # token ids as a table
        res(token_ids=-np.ones(n, np.int64)),  # negative token ids
        res(topk_ids=np.zeros(n, np.int64)),  # top-k as a vector
        res(ranks=np.ones(n + 2, np.int64), sampling_mass=np.ones(1, np.float32)),
        res(prompt_logprobs=[lp]),
        res(routed_experts=np.zeros((1, 1, 1), np.uint8), routed_spans=[(ids[0] if ids else "x", 0, 0, 9)]),
    ]


def test_wrong_step_results_for_the_step_in_flight_are_dropped(server):
    """A fake worker answers every plan at once, with results of the right step id that do not fit the step:
    the scheduler logs and drops the ones that arrive before the real worker's, whose results complete every
    step; the tokens are those of the same greedy request without the fake. Which of the two answers first
    is up to the machine: the request is repeated (each time checked whole) until every kind of wrong
    result was seen first at least once."""
    ep = Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}")
    pids = server.child_pids()
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    kinds = ("rank 7 does not exist", "rank -1 does not exist", "sequences the step did not run", "is not a",
             "negative token id", "topk ids and logprobs", "prompt logprobs of a sequence the step did not run",
             "a routed span outside the rows")
    stop, sent = threading.Event(), []
    ctx = zmq.Context()
    sub = make_socket(ctx, zmq.SUB, connect=ep.plans)
    sub.setsockopt(zmq.SUBSCRIBE, PLAN_TOPIC)
    push = make_socket(ctx, zmq.PUSH, connect=ep.results)

    def fake_worker() -> None:
        while not stop.is_set():
            if not sub.poll(20):
                continue
            plan = decode(sub.recv_multipart()[1:])
            if isinstance(plan, StepPlan) and plan.seq_ids:
                bad = wrong_results(plan)
                k = len(sent) % len(bad)  # a different one first each step
                for r in bad[k:] + bad[:k]:
                    send(push, r)
                sent.append(plan.step_id)

    with httpx.Client(base_url=server.url, timeout=120) as h:
        wait_for(lambda: h.get("/health").status_code == 200, 30, "the server")
        clean = h.post("/v1/completions", json=body)
        assert clean.status_code == 200, clean.text
        t = threading.Thread(target=fake_worker)
        tries = 0
        try:
            deadline = time.monotonic() + 120
            t.start()
            while not sent:  # the SUB is connected once it sees plans
                assert time.monotonic() < deadline, "the fake worker never saw a plan"
                h.post("/v1/completions", json={**body, "max_tokens": 1})
            while tries == 0 or not all(k in server.log() for k in kinds):
                assert time.monotonic() < deadline, [k for k in kinds if k not in server.log()]
                fuzzed = h.post("/v1/completions", json=body)
                tries += 1
                assert fuzzed.status_code == 200, fuzzed.text
                assert fuzzed.json()["usage"]["completion_tokens"] == 60
                assert fuzzed.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"]
                assert fuzzed.json()["choices"][0]["logprobs"] == clean.json()["choices"][0]["logprobs"]
        finally:
            stop.set()
            t.join(10)
            ctx.destroy(linger=0)
    log = server.log()
    assert server.proc.poll() is None and server.child_pids() == pids
    assert "member_lost" not in log and "Traceback" not in log


class FakeCoordinator:
    """Binds the control ROUTER and commands XPUB, welcomes whoever says Hello, publishes what it is told."""

    def __init__(self, ctx: zmq.Context, ep: Endpoints):
        self.router = make_socket(ctx, zmq.ROUTER, bind=ep.control)
        self.pub = make_socket(ctx, zmq.XPUB, bind=ep.commands)

    def welcome(self, name: str, timeout_s: float = 10.0) -> None:
        """Wait for `name`'s presence subscription and its Hello, then welcome it at seq 0."""
        from bus.codec import decode
        from bus.sockets import member_name, subscription_event

        subscribed = hello = False
        deadline = time.monotonic() + timeout_s
        while not (subscribed and hello):
            assert time.monotonic() < deadline, f"{name} never joined"
            if self.pub.poll(50):
                on, topic = subscription_event(self.pub.recv())
                subscribed |= on and member_name(topic) == name
            if self.router.poll(50):
                frames = self.router.recv_multipart()
                msg = decode(frames[1:])
                hello |= isinstance(msg, Hello) and msg.name == name
        send(self.router, Welcome(True, "", 0, ControlState()), to=name.encode())

    def publish_garbage_then(self, *cmds: Command) -> None:
        for _, frames in garbage():
            self.pub.send_multipart([COMMAND_TOPIC, *frames])
        self.pub.send_multipart([COMMAND_TOPIC])  # a topic and nothing else
        for c in cmds:
            send(self.pub, c, topic=COMMAND_TOPIC)


def test_a_member_drops_garbage_on_its_sub_socket(tmp_path):
    ep = Endpoints.from_config(bus_config(tmp_path))
    ctx = zmq.Context()
    try:
        coord = FakeCoordinator(ctx, ep)
        m = MemberThread(ep, "worker-0", timeout=60)
        coord.welcome("worker-0")
        assert m.welcomed.wait(10)
        coord.publish_garbage_then(Command(1, Health()))
        wait_for(lambda: m.applied == [(1, "health")], 10, "the command after the garbage")
        assert m.error is None and m.thread.is_alive()
        m.close()
    finally:
        ctx.destroy(linger=0)


def test_the_gateway_drops_garbage_on_its_sub_socket_and_follows_the_stream(tmp_path):
    from gateway.engine_client import EngineClient

    ep = Endpoints.from_config(bus_config(tmp_path))
    ctx = zmq.Context()

    async def run() -> None:
        client = EngineClient(ep, name="gateway-t", heartbeat_interval_s=0.2, heartbeat_timeout_s=30)
        start = asyncio.create_task(client.start(timeout_s=20))
        await asyncio.to_thread(coord.welcome, "gateway-t")
        await start
        seen = []
        lost = client.follower.handlers[MemberLost]
        client.follower.on(MemberLost, lambda c: (seen.append(c.name), lost(c)))
        await asyncio.to_thread(coord.publish_garbage_then, Command(1, MemberLost("gateway-x", "gateway", "test")),
                                Command(3, Health()))  # seq 2 is missing: a gap, so it asks again
        deadline = time.monotonic() + 10
        while client.follower.seq is not None:  # resyncing: it dropped its position after the gap
            assert time.monotonic() < deadline, "the gateway never noticed the gap"
            await asyncio.sleep(0.02)
        assert seen == ["gateway-x"]  # seq 1 came through the garbage and was applied
        assert client.healthy and client.follower.seq is None
        hello = await asyncio.to_thread(_next, coord, Hello)
        assert hello.name == "gateway-t"  # the resync Hello
        await client.close()

    try:
        coord = FakeCoordinator(ctx, ep)
        asyncio.run(run())
    finally:
        ctx.destroy(linger=0)


class FakeScheduler:
    """Binds the plans XPUB and the results PULL, as the scheduler does."""

    def __init__(self, ctx: zmq.Context, ep: Endpoints):
        self.plans = make_socket(ctx, zmq.XPUB, bind=ep.plans)
        self.results = make_socket(ctx, zmq.PULL, bind=ep.results)

    def wait_worker(self, name: str, timeout_s: float) -> None:
        """The worker's Hello on results and its plan and presence subscriptions, as wait_for_workers does."""
        from bus.endpoints import presence_topic
        from bus.sockets import subscription_event

        topics, hello = set(), False
        deadline = time.monotonic() + timeout_s
        while not (hello and {PLAN_TOPIC, presence_topic(name)} <= topics):
            assert time.monotonic() < deadline, f"{name} never reached the scheduler"
            if self.plans.poll(50):
                on, topic = subscription_event(self.plans.recv())
                if on:
                    topics.add(topic)
            if self.results.poll(50):
                msg = decode(self.results.recv_multipart())
                hello |= isinstance(msg, Hello) and msg.name == name

    def run(self, plan: StepPlan, timeout_s: float = 30.0) -> StepResult:
        send(self.plans, plan, topic=PLAN_TOPIC)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.results.poll(100):
                res = decode(self.results.recv_multipart())
                if isinstance(res, StepResult) and res.step_id == plan.step_id:
                    return res
        raise AssertionError(f"no result for step {plan.step_id}")


def plan_of(step_id: int, seq_id: str) -> StepPlan:
    from bus.sampling_params import SamplingParams

    new = NewSeq(seq_id, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), [])
    return StepPlan(step_id, [new], [seq_id], [0], [3], [[step_id]], [], 0)


def plan_garbage() -> list[list[bytes]]:
    """What a plan SUB must survive, besides garbage(): plans of the wrong shape, and messages that are
    not plans."""
    return [
        *(frames for _, frames in garbage()),
        _raw(StepPlan.KIND, [1, [], "not a list", [0], [3], [[0]], [], 0]),  # wrong field type
        _raw(StepPlan.KIND, [1, [["s", [1], {"max_tokens": 2}, []]], ["s"], [0], [1], [[0]], [], 0]),  # dict params
        _raw(StepPlan.KIND, [1, [], ["s"]]),  # missing fields
        _raw(StepPlan.KIND, [1, [], [], [], [], [], [], 0, "surplus"]),  # an unknown field
        [bytes(f) for f in encode(Hello("worker", "x", 1, 1))],  # a message that is not a plan
    ]


def test_a_worker_drops_garbage_on_its_plan_and_abort_watch_sub_sockets(tmp_path):
    """A real worker process between a fake coordinator and a fake scheduler: garbage on its plan SUB (plan
    and presence topics) and on the command SUB its member link and its abort watcher both read is logged
    and dropped; afterwards it still follows commands, executes a valid plan, and its abort watcher still
    interrupts a step."""
    from bus.endpoints import presence_topic
    from bus.messages import Pause

    with lone_worker(tmp_path) as (coord, sched, proc, log_path):
        for topic in (PLAN_TOPIC, presence_topic("worker-0")):
            for frames in plan_garbage():
                sched.plans.send_multipart([topic, *frames])
            sched.plans.send_multipart([topic])  # a topic and nothing else
        coord.publish_garbage_then(Command(1, Health()))
        ack = _next(coord, Ack)
        assert ack.seq == 1 and ack.ok, ack  # its member link read through the garbage
        res = sched.run(plan_of(1, "s1"))
        assert res.error is None and not res.interrupted and res.seq_ids == ["s1"] and res.token_ids.shape == (1,)
        # The abort watcher read through the same garbage: an abort pause it sees before the member link
        # applies it (here: the link waits for seqs 2..8 first) interrupts the next step.
        send(coord.pub, Command(9, Pause("abort")), topic=COMMAND_TOPIC)
        deadline, step = time.monotonic() + 20, 2
        while not (res := sched.run(plan_of(step, f"s{step}"))).interrupted:
            assert time.monotonic() < deadline, "the abort watcher never interrupted a step"
            step += 1
        assert res.error is None and proc.poll() is None
        out = log_path.read_text()
        assert "worker.bad_plan" in out and "a Hello where a StepPlan goes" in out
        assert "worker.abort_watch_bad_message" in out and "bus.bad_message" in out
        assert "Traceback" not in out, out[-3000:]


@contextlib.contextmanager
def lone_worker(tmp_path):
    """A real worker process (a tiny llama) between a FakeCoordinator and a FakeScheduler, joined and
    subscribed: yields (coordinator, scheduler, process, log path); stops it after."""
    import subprocess
    import sys

    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint("llama", tmp_path / "llama")
    cfg = bus_config(tmp_path / "bus", model=str(folder), max_model_len=256, num_gpu_blocks_override=64,
                     heartbeat_timeout_s=120)
    ep = Endpoints.from_config(cfg)
    ctx = zmq.Context()
    log_path = tmp_path / "worker.log"
    proc = None
    try:
        coord, sched = FakeCoordinator(ctx, ep), FakeScheduler(ctx, ep)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "worker", "--rank", "0", *cfg.to_argv()],
                                    stdout=log, stderr=subprocess.STDOUT)
        coord.welcome("worker-0", timeout_s=120)
        sched.wait_worker("worker-0", timeout_s=30)
        yield coord, sched, proc, log_path
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        ctx.destroy(linger=0)


def _next(coord: FakeCoordinator, kind: type):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if coord.router.poll(100):
            msg = decode(coord.router.recv_multipart()[1:])
            if isinstance(msg, kind):
                return msg
    raise AssertionError(f"no {kind.__name__}")
