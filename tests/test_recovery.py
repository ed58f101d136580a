"""Recovery instead of shutdown (issue 11 item 2): `rollbus serve` restarts a dead child alone, a member
declared lost that runs again rejoins, and a restarted worker serves the weights the engine was serving,
bitwise, or says it cannot. Real processes, real sockets; one server shared by the module's tests (they
run in order: the weight-update tests build on each other)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
import torch
import zmq

from bus.codec import decode
from bus.endpoints import WEIGHTS_TOPIC, Endpoints
from bus.messages import Members, WeightVersionLost
from engine.restart_policy import RestartPolicy
from engine.trainer import WeightSyncClient
from gateway.engine_client import EngineClient
from tests.bus_helpers import ControlClient, bus_config, start_coordinator
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from tests.tiny_models import perturb
from tests.waits import recv_topic, wait_for, wait_subscribed

pytestmark = pytest.mark.timeout(300)
RL = '{"rl_config": {"enabled": true}}'
PROMPT = [5, 17, 99, 250, 31, 8, 77]
# Tokens of a stream that must still be running when its worker is killed: the tiny model decodes 32
# streams of 240 tokens in about a second on a fast host, while the 32nd stream may only be starting.
LONG = 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    work = tmp_path_factory.mktemp("recovery")
    folder = tiny_model_with_tokenizer("llama", work / "llama", smollm2_dir, max_position_embeddings=LONG + 16)
    s = start_server(work, str(folder), "--max-model-len", str(LONG + 16), "--additional-config", RL,
                     "--weight-transfer-config", '{"backend": "ipc"}', "--weights-recovery-dir", str(work / "copies"))
    s.folder, s.copies = folder, work / "copies"
    yield s
    s.stop()


def rank_header(engine: int | None) -> dict[str, str]:
    """X-data-parallel-rank naming `engine` (None: the gateway's router picks)."""
    return {} if engine is None else {"X-data-parallel-rank": str(engine)}


def greedy(url: str, engine: int | None = None) -> tuple[list[int], list[float]]:
    r = httpx.post(url + "/v1/completions", timeout=60, headers=rank_header(engine), json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def checksums(url: str) -> dict[str, str]:
    r = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


def completion(url: str, engine: int | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30, headers=rank_header(engine),
                      json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})


def wait_serving(url: str, timeout_s: float = 30.0) -> float:
    """Seconds until a completion succeeds again."""
    t0 = time.monotonic()

    def ok() -> bool:
        try:
            return completion(url).status_code == 200
        except httpx.HTTPError:  # a restarting gateway refuses connections
            return False

    wait_for(ok, timeout_s, "the engine serving again", interval_s=0.1)
    return time.monotonic() - t0


class Streams:
    """`n` streaming completions in threads, each long enough to be running when its process dies."""

    def __init__(self, url: str, n: int, max_tokens: int = 240, headers: list[dict[str, str]] | None = None):
        self.headers = headers or [{}] * n  # per stream (X-data-parallel-rank: tests/test_data_parallel.py)
        self.first = [threading.Event() for _ in range(n)]
        self.ended: list[float | None] = [None] * n
        self.lines: list[list[str]] = [[] for _ in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(url, i, max_tokens), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, headers=self.headers[i], json={
                    "prompt": [1, 2, 3 + i], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines[i].append(line)
                        self.first[i].set()
        except httpx.HTTPError as e:
            self.lines[i].append(f"transport error {e!r}")
        self.ended[i] = time.monotonic()
        self.first[i].set()

    def wait_running(self, timeout_s: float = 60.0, must_run: tuple[int, ...] | None = None) -> None:
        """Every stream has started, and those in `must_run` (all by default) have not ended yet."""
        deadline = time.monotonic() + timeout_s
        for e in self.first:
            assert e.wait(max(0.0, deadline - time.monotonic())), "a stream never started"
        done = [i for i, t in enumerate(self.ended) if t is not None and (must_run is None or i in must_run)]
        assert not done, f"streams {done} finished before the kill: make them longer"

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream hung"


def kill_and_watch_streams(server, role: str, n: int = 32, engine: int | None = None,
                           max_tokens: int = 240) -> tuple[float, list[str]]:
    """SIGKILL `role` under `n` running streams of `max_tokens` (on data-parallel `engine`, if given); (seconds
    until the last stream ended, their last lines)."""
    streams = Streams(server.url, n, max_tokens=max_tokens, headers=[rank_header(engine)] * n)
    streams.wait_running()
    pid = server.child_pids()[role]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    streams.join(30)
    return max(t - killed for t in streams.ended), ["\n".join(ls[-2:]) for ls in streams.lines]


def test_a_killed_worker_under_32_streams_is_restarted_alone_and_serves_the_same_weights(server):
    url = server.url
    sums, before = checksums(url), greedy(url)
    pids = server.child_pids()
    ended_s, last = kill_and_watch_streams(server, "worker-0", max_tokens=LONG)
    killed = time.monotonic()
    assert ended_s < 5.0, f"the streams took {ended_s:.2f}s to end"
    for text in last:  # each ends with an error event naming the lost worker, then [DONE]
        assert '"error"' in text and "worker-0" in text and text.endswith("data: [DONE]"), text
    back_s = wait_serving(url)
    print(f"\nSIGKILL worker-0 under 32 streams: all ended {ended_s:.2f}s after, serving again after {back_s:.1f}s")
    assert time.monotonic() - killed < 30
    now = server.child_pids()
    assert now["worker-0"] != pids["worker-0"]
    assert {r: p for r, p in now.items() if r != "worker-0"} == {r: p for r, p in pids.items() if r != "worker-0"}
    assert checksums(url) == sums  # the checkpoint again, bitwise
    assert greedy(url) == before
    assert "restarting it in" in server.log() and "worker-0 is back" in server.log()


def perturbed_model(folder, seed: int):
    """The checkpoint at `folder` with every weight moved by noise: a trainer's next version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    perturb(model, seed)
    return model


@pytest.fixture(scope="module")
def trainer(server):
    return perturbed_model(server.folder, 7)


def weight_version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]


def test_after_a_weight_update_a_killed_worker_comes_back_with_that_update(server, trainer):
    url = server.url
    old = checksums(url)
    with WeightSyncClient(url, backend="ipc") as client:
        client.send_weights(trainer.named_parameters(), version="step-1", pause="keep")
    sums, before = checksums(url), greedy(url)
    assert sums != old
    ended_s, _ = kill_and_watch_streams(server, "worker-0", n=4, max_tokens=LONG)
    assert ended_s < 5.0
    back_s = wait_serving(url)
    print(f"\nafter an update, SIGKILL worker-0: serving step-1 again after {back_s:.1f}s")
    assert checksums(url) == sums  # the recovery copy, not the checkpoint
    assert greedy(url) == before
    assert weight_version(url) == "step-1"


def test_without_a_copy_the_version_is_lost_until_the_trainer_sends_it_again(server, trainer):
    url = server.url
    sums, before = checksums(url), greedy(url)
    (server.copies / "worker-0.safetensors").unlink()  # what a worker started without --weights-recovery-dir has
    bus_dir = server.log_path.parent / f"bus-{server.port}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(Endpoints.from_url(f"ipc://{bus_dir}").commands)
    sub.setsockopt(zmq.SUBSCRIBE, WEIGHTS_TOPIC)
    try:
        wait_subscribed(sub)
        os.kill(server.child_pids()["worker-0"], signal.SIGKILL)
        msg = decode(recv_topic(sub, WEIGHTS_TOPIC, 30))  # what a trainer listening on topic W hears
        assert isinstance(msg, WeightVersionLost) and msg.version == "step-1" and msg.member == "worker-0", msg
    finally:
        ctx.destroy(linger=0)

    def refused() -> httpx.Response | None:
        r = completion(url)
        return r if r.status_code == 503 and "step-1" in r.text else None

    r = wait_for(refused, 30, "a 503 naming the lost version")
    assert r.json()["error"]["type"] == "ServiceUnavailableError", r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    with WeightSyncClient(url, backend="ipc") as client:  # the trainer sends the weights again
        client.send_weights(trainer.named_parameters(), version="step-1", pause="keep")
    wait_serving(url)
    assert checksums(url) == sums and greedy(url) == before


@pytest.mark.parametrize("role", ["worker-0", "scheduler"])
def test_a_stalled_process_is_lost_then_rejoins_without_a_restart(server, role):
    """SIGSTOP past the heartbeat timeout (3 s), SIGCONT: the running stream ends with an error, and the
    process rejoins through Hello/Welcome; no process is restarted."""
    url = server.url
    before = greedy(url)
    pids = server.child_pids()
    streams = Streams(url, 1)
    streams.wait_running()
    os.kill(pids[role], signal.SIGSTOP)
    stopped = time.monotonic()
    queued: dict = {}

    def queue_one() -> None:  # sent while the step in flight waits on the stalled worker: queued, not running
        queued["r"] = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True})

    waiter = threading.Thread(target=queue_one)
    if role == "worker-0":
        waiter.start()
    try:
        streams.join(15)
        ended_s = streams.ended[0] - stopped
        assert ended_s < 3 + 3, f"the stream took {ended_s:.1f}s to end"
        assert '"error"' in streams.lines[0][-2], streams.lines[0][-2:]
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # lost, not back yet
    finally:
        os.kill(pids[role], signal.SIGCONT)
    back_s = wait_serving(url)
    print(f"\n{role} stalled: stream ended {ended_s:.1f}s after SIGSTOP; serving {back_s:.1f}s after SIGCONT")
    if role == "worker-0":  # the queued request ran after the worker came back, as if nothing happened
        waiter.join(30)
        assert queued["r"].status_code == 200, queued["r"].text
        lp = queued["r"].json()["choices"][0]["logprobs"]
        assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == before[0]
        # batched with wait_serving's probe: equal up to batch-dependent rounding (no batch invariance here)
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"], before[1])) < 1e-4
    assert server.child_pids() == pids
    assert greedy(url) == before
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_stalled_gateway_fails_its_open_requests_and_rejoins(server):
    """SIGSTOP the gateway past the heartbeat timeout: the coordinator drops it and the scheduler aborts
    its requests; after SIGCONT its open stream ends with an error at once and it serves again."""
    url = server.url
    pids = server.child_pids()
    gateway = f"gateway-{pids['gateway']}"
    control = ControlClient(Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}"))
    try:  # closed and resumed whatever happens: a leaked client's context can hang a later test's GC
        streams = Streams(url, 1)
        streams.wait_running()
        # Held (keep mode) so the stream cannot simply finish while the gateway is stopped: on the tiny
        # model its 240 tokens take less than the heartbeat timeout, and then nothing is left to fail.
        assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        os.kill(pids["gateway"], signal.SIGSTOP)
        try:
            wait_for(lambda: gateway not in control.request(Members()).results, 15, "the gateway declared lost")
        finally:
            os.kill(pids["gateway"], signal.SIGCONT)
        resumed = time.monotonic()
        streams.join(15)
        assert httpx.post(url + "/resume", timeout=30).status_code == 200
        assert streams.ended[0] - resumed < 3, "the stream did not end soon after the gateway resumed"
        last = streams.lines[0][-2]
        assert '"error"' in last and "declared lost" in last, streams.lines[0][-2:]
        wait_serving(url)
        wait_for(lambda: gateway in control.request(Members()).results, 10, "the gateway back as a member")
    finally:
        httpx.post(url + "/resume", timeout=30)  # (a no-op when already resumed)
        control.close()
    assert server.child_pids() == pids


@pytest.mark.parametrize("role", ["scheduler", "gateway"])
def test_a_killed_scheduler_or_gateway_is_restarted_alone(server, role):
    url = server.url
    before = greedy(url)
    pids = server.child_pids()
    os.kill(pids[role], signal.SIGKILL)
    back_s = wait_serving(url)
    print(f"\nSIGKILL {role}: serving again after {back_s:.1f}s")
    wait_for(lambda: server.child_pids().get(role) not in (None, pids[role]), 10, f"the new {role}")
    now = server.child_pids()
    assert {r: p for r, p in now.items() if r != role} == {r: p for r, p in pids.items() if r != role}
    assert greedy(url) == before


def test_with_two_engines_a_restarted_worker_takes_the_update_from_its_peer(tmp_path, smollm2_dir, trainer):
    """No --weights-recovery-dir, -dp 2: after an update, a killed worker-1 (engine 1) loads a copy of the
    worker with its tp rank in the other engine, worker-0 (ShareWeights)."""
    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256", "-dp", "2",
                     "--kv-cache-memory-bytes", "67108864", "--additional-config", RL,
                     "--weight-transfer-config", '{"backend": "ipc"}')
    try:
        with WeightSyncClient(s.url, backend="ipc") as client:
            client.send_weights(trainer.named_parameters(), version="peer-1", pause="keep")
        sums, before = checksums(s.url), greedy(s.url)
        ended_s, last = kill_and_watch_streams(s, "worker-1", n=4, engine=1)
        assert ended_s < 5.0
        assert all("worker-1" in text for text in last), last  # engine 1's streams failed naming it
        back_s = wait_serving(s.url)
        wait_for(lambda: completion(s.url, 1).status_code == 200, 30, "engine 1 serving again")
        print(f"\n-dp 2, SIGKILL worker-1 after an update: serving peer-1 again after {back_s:.1f}s")
        assert checksums(s.url) == sums and greedy(s.url, 0) == before == greedy(s.url, 1)
        assert "worker.weights_from_peer" in s.log() and "donor=worker-0" in s.log()
    finally:
        s.stop()


def test_a_crash_looping_child_stops_the_launcher_with_a_clear_message(tmp_path, smollm2_dir):
    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256", "--max-restarts", "1")
    try:
        first = s.child_pids()["worker-0"]
        os.kill(first, signal.SIGKILL)
        wait_serving(s.url)
        os.kill(s.child_pids()["worker-0"], signal.SIGKILL)
        assert s.proc.wait(30) == 1
        assert "giving up, stopping all processes" in s.log() and "--max-restarts 1" in s.log(), s.log()[-2000:]
        assert not list((tmp_path / f"bus-{s.port}").iterdir())  # no ipc socket file left behind
    finally:
        s.stop()


def test_a_dead_coordinator_stops_everything_saying_why(server):
    """The last test on the shared server: the coordinator is not restarted (its control state cannot be
    rebuilt), the launcher stops every process and exits 1."""
    pids = server.child_pids()
    os.kill(pids["coordinator"], signal.SIGKILL)
    assert server.proc.wait(30) == 1
    assert "the control state (pauses, weight versions, membership) lived in it" in server.log()
    wait_for(lambda: not server.child_pids(), 10, "every child gone")
    assert not list((server.log_path.parent / f"bus-{server.port}").iterdir())  # no ipc socket file left


def test_membership_and_lost_versions_in_the_control_state():
    from bus.control_state import engine_down_message, initial_state, reduce, weights_lost_message
    from bus.messages import CommitWeightUpdate, MemberJoined, MemberLost, WeightsLost

    s = initial_state("run-1")
    s = reduce(s, MemberLost("gateway-9", "gateway", "disconnected"))
    assert s.lost == {} and engine_down_message(s) is None  # a gateway gone is not the engine down
    s = reduce(s, MemberLost("worker-0", "worker", "no heartbeat for 3.0s"))
    assert "worker-0 (no heartbeat for 3.0s)" in engine_down_message(s)
    s = reduce(s, MemberJoined("worker-0", "worker", 42))
    assert s.lost == {} and engine_down_message(s) is None
    s = reduce(reduce(s, CommitWeightUpdate("step-1")), WeightsLost("step-1", 1, "worker-0", "no copy"))
    assert s.weight_commits == 1 and s.run_id == "run-1" and "'step-1' was lost" in weights_lost_message(s)
    s = reduce(s, CommitWeightUpdate("step-1"))  # the trainer sent it again
    assert s.weights_lost is None and weights_lost_message(s) is None and s.weight_commits == 2


def test_restart_policy_backs_off_then_gives_up():
    p = RestartPolicy(max_restarts=3, window_s=60)
    assert [p.on_exit("worker-0", t) for t in (0, 1, 2)] == [0.5, 1.0, 2.0]
    assert p.on_exit("worker-0", 3) is None  # a fourth death within the minute
    assert p.on_exit("gateway", 3) == 0.5  # counted per child
    assert p.on_exit("worker-0", 70) == 0.5  # the old deaths left the window
    assert RestartPolicy(max_restarts=0).on_exit("worker-0", 0) is None


def test_a_gateway_whose_event_loop_is_blocked_stays_a_member(tmp_path):
    """The gateway's heartbeat is a thread: its event loop blocked for over twice the heartbeat timeout
    (what parsing a huge request did) costs nothing; the same block without heartbeats got it lost."""
    cfg = bus_config(tmp_path)  # heartbeats every 0.2 s, lost after 1.5 s
    coordinator = start_coordinator(cfg)
    ep = Endpoints.from_config(cfg)
    control = ControlClient(ep)
    seen: dict = {}

    async def gateway() -> None:
        client = EngineClient(ep, name="gateway-blocked", heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)
        await client.start(timeout_s=30)
        try:
            time.sleep(3.5)  # the loop blocked, no await
            seen["members"] = set(control.request(Members()).results)
            await asyncio.sleep(0.5)  # the readers catch up with what arrived meanwhile
            seen["dead_reason"] = client.dead_reason
        finally:
            await client.close()

    try:
        asyncio.run(gateway())
    finally:
        control.close()
        coordinator.terminate()
        coordinator.wait(10)
    assert "gateway-blocked" in seen["members"], seen
    assert seen["dead_reason"] is None, seen


@pytest.mark.slow
def test_under_a_supervisor_a_restarted_coordinator_makes_the_others_start_fresh(tmp_path, smollm2_dir):
    """The honcho-export / supervisord case (every process restarted alone, the coordinator too): a new
    coordinator starts from the initial control state, so the scheduler and worker exit (a supervisor
    starts them again) and the gateway resyncs; then the engine serves again."""
    import subprocess
    import sys

    from engine.config import EngineConfig
    from tests.server_helpers import free_port, sized_for_tests

    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    cfg = sized_for_tests(EngineConfig.from_flags(model=str(folder), port=free_port(), bus_dir=str(tmp_path / "bus"),
                                       max_model_len=256))
    url = f"http://127.0.0.1:{cfg.gateway.port}"
    logs = {r: open(tmp_path / f"{r}.log", "w") for r in ("coordinator", "scheduler", "worker", "gateway")}

    def start(r: str) -> subprocess.Popen:
        extra = ["--rank", "0"] if r == "worker" else []
        return subprocess.Popen([sys.executable, "-m", "engine.cli", r, *extra, *cfg.to_argv()], stderr=logs[r])

    procs = {r: start(r) for r in logs}
    try:
        wait_serving(url, 120)
        procs["coordinator"].kill()
        procs["coordinator"].wait()
        procs["coordinator"] = start("coordinator")  # what supervisord's autorestart does
        for r in ("scheduler", "worker"):
            assert procs[r].wait(30) != 0
            assert "coordinator" in (tmp_path / f"{r}.log").read_text()
            procs[r] = start(r)
        assert procs["gateway"].poll() is None  # the gateway stays, and follows the new coordinator
        wait_serving(url, 120)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(10)
