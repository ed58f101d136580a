"""Data parallelism (issue 13 items 3-5): `-dp M` engines behind one gateway. The layout, router and header
policies are pure and tested in microseconds; the rest runs a real `rollbus serve -dp 2` (one server for the
module; the tests run in order: the weight update, then the failure of one engine's worker)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import zmq

from bus.control import ControlLedger, Member
from bus.endpoints import Endpoints
from bus.messages import Ack, CommitWeightUpdate, Health, Layout, Members, SchedulerInfo
from bus.topology import Topology
from engine.config import EngineConfig, parse_config
from engine.launcher import roles
from engine.topology import check_devices, layout_mismatch
from engine.trainer import WeightSyncClient
from gateway.dp_router import HEADER, Balancer, RankHeaderError, parse_rank_header
from tests.bus_helpers import ControlClient
from tests.serve_process import free_port_range
from tests.server_helpers import free_port, start_server, tiny_model_with_tokenizer
from tests.test_recovery import RL, Streams, checksums, completion, greedy, perturbed_model, rank_header
from tests.waits import wait_for
from workers.models.checkpoint import load_hf_config
from workers.models.registry import shard_checksums

# --- the layout (bus.topology) --------------------------------------------------------------------


def test_one_engine_keeps_todays_names_and_sockets(tmp_path):
    t = Topology()
    assert t.members(0) == ["scheduler", "worker-0"] and t.world_size == 1
    ep = Endpoints.from_config(EngineConfig.from_flags(bus_transport="ipc", bus_dir=str(tmp_path / "bus"), port=0))
    assert [a.rsplit("/", 1)[1] for a in (ep.requests, ep.plans, ep.results, ep.control, ep.commands)] == \
        ["requests", "plans", "results", "control", "commands"]


def test_engines_and_workers_are_named_by_the_global_worker_index():
    t = Topology(dp=2, tp=2, dp_local=2)
    assert t.members(0) == ["scheduler-0", "worker-0", "worker-1"]
    assert t.members(1) == ["scheduler-1", "worker-2", "worker-3"]
    assert [t.engine_of(n) for n in ("scheduler-1", "worker-3", "worker-4", "scheduler", "gateway-7")] == \
        [1, 1, None, None, None]
    assert t.donor(1, 1) == "worker-1" and t.donor(0, 0) == "worker-2"  # the same tp rank, another engine
    assert Topology(dp=2, dp_local=1, dp_start=1).donor(1, 0) is None  # no other engine on this host
    assert t.world_size == 4 and t.local_device(1, 1) == 3


def test_every_engine_has_its_own_requests_plans_and_results(tmp_path):
    cfg = parse_config(["-dp", "3", "--bus-dir", str(tmp_path / "bus"), "--data-parallel-rank", "2"])
    ep = Endpoints.from_config(cfg)
    names = [[a.rsplit("/", 1)[1] for a in e] for e in ep.engines]
    assert names == [["requests", "plans", "results"], ["requests-1", "plans-1", "results-1"],
                     ["requests-2", "plans-2", "results-2"]]
    assert ep.requests.endswith("/requests-2") and ep.engine(1).plans.endswith("/plans-1")
    tcp = Endpoints.from_config(parse_config(["-dp", "3", "--bus-transport", "tcp", "--bus-insecure",
                                              "--bus-port-base", "7000"]))
    ports = [int(a.rsplit(":", 1)[1]) for a in tcp.all_addresses()]
    assert sorted(ports) == list(range(7000, 7011)) and len(set(ports)) == len(ports)
    assert tcp.control.endswith(":7003") and tcp.engine(0).requests.endswith(":7000")


def test_the_launcher_starts_each_local_engine_and_the_head_runs_coordinator_and_gateway():
    names = [n for n, _ in roles(parse_config(["-dp", "2"]))]
    assert names == ["coordinator", "scheduler-0", "worker-0", "scheduler-1", "worker-1", "gateway"]
    argv = dict(roles(parse_config(["-dp", "2"])))
    assert argv["worker-1"] == ["worker", "--rank", "0", "--data-parallel-rank", "1"]
    other = [n for n, _ in roles(parse_config(["-dp", "4", "-dpl", "2", "--data-parallel-start-rank", "2"]))]
    assert other == ["scheduler-2", "worker-2", "scheduler-3", "worker-3"]  # a second host: engines only
    assert [n for n, _ in roles(parse_config([]))] == ["coordinator", "scheduler", "worker-0", "gateway"]


def test_on_cpu_each_local_worker_gets_its_share_of_the_cores_unless_the_user_chose():
    from engine.launcher import cpu_thread_share

    share = cpu_thread_share(Topology(dp=2, dp_local=2), {}, "cpu")
    assert share == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    assert cpu_thread_share(Topology(dp=2, dp_local=2), {"OMP_NUM_THREADS": "3"}, "cpu") == {}
    assert cpu_thread_share(Topology(), {}, "cpu") == {}
    assert cpu_thread_share(Topology(dp=2, dp_local=2), {}, "cuda") == {}


def refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    return str(e.value)


def test_bad_layouts_are_refused_naming_the_value():
    assert "--data-parallel-size-local 3" in refusal(["-dp", "2", "-dpl", "3"])
    assert "--data-parallel-start-rank 1" in refusal(["-dp", "2", "-dpr", "1"])
    assert "--data-parallel-rank 2" in refusal(["-dp", "2", "--data-parallel-rank", "2"])
    with pytest.raises(SystemExit):  # argparse: -dp 0 is not a size
        parse_config(["-dp", "0"])
    text = refusal(["--num-workers", "2"])
    assert "--num-workers 2" in text and "--data-parallel-size" in text and "--tensor-parallel-size" in text


def test_more_engines_than_devices_is_refused_on_accelerators_only():
    assert check_devices(Topology(dp=8, dp_local=8), "cpu", 1) is None  # CPU: engines share the cores
    why = check_devices(Topology(dp=4, tp=2, dp_local=4), "cuda", 4)
    assert "--data-parallel-size 4" in why and "--tensor-parallel-size 2" in why and "4 are present" in why
    assert check_devices(Topology(dp=4, dp_local=2, dp_start=2), "npu", 2) is None  # two engines per host


def test_a_member_started_with_other_flags_is_named_with_the_value():
    own = Layout("m", 1, 2, None, 16, "auto", "auto")
    assert layout_mismatch(own, msgspec.structs.replace(own)) is None and layout_mismatch(own, None) is None
    why = layout_mismatch(own, msgspec.structs.replace(own, model="other", data_parallel_size=3))
    assert "model 'other' (coordinator: 'm')" in why and "data_parallel_size 3 (coordinator: 2)" in why


# --- the router (gateway.dp_router) ------------------------------------------------------------------


def test_the_rank_header_names_an_engine_or_is_a_400_naming_it():
    assert parse_rank_header(None, 2) is None and parse_rank_header(" 1 ", 2) == 1
    for bad in ("2", "-1", "one", "1.0", ""):
        with pytest.raises(RankHeaderError, match=HEADER):
            parse_rank_header(bad, 2)


def test_the_balancer_picks_the_least_outstanding_work_among_live_engines():
    b = Balancer.of(3)
    picks = [b.pick([True] * 3) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]  # equal loads: rotate instead of piling onto engine 0
    b.add("a", 0, 100)
    b.add("b", 1, 10)
    assert b.pick([True] * 3) == 2  # fewest requests in flight
    b.add("c", 2, 50)
    assert b.pick([True] * 3) == 1  # then fewest tokens
    assert b.pick([True, False, True]) == 2 and b.pick([False] * 3) is None
    b.done("a")
    assert b.loads[0].requests == 0 and b.pick([True] * 3) == 0 and b.engine_of("b") == 1
    b.done("a")  # twice: no negative load
    assert b.loads[0].requests == 0 and b.open_on(2) == ["c"]


def test_a_command_waits_for_every_worker_of_every_engine():
    """A commit is acked by every scheduler and worker of every engine (bus.control's waiting set): until
    engine 1's worker has it, nothing is committed (no reply, no WeightVersionCommitted)."""
    ledger = ControlLedger()
    topo = Topology(dp=2, dp_local=2)
    for e in topo.engines:
        for name in topo.members(e):
            ledger.join(Member(name, name.split("-")[0], 1, 0.0))
    ledger.join(Member("gateway-1", "gateway", 1, 0.0))
    cmd, done = ledger.publish(CommitWeightUpdate("v1"), now=0.0, timeout_s=10)
    assert not done and ledger.pending[cmd.seq].waiting == {"scheduler-0", "worker-0", "scheduler-1", "worker-1"}
    for name in ("scheduler-0", "worker-0", "scheduler-1"):
        assert ledger.ack(Ack(cmd.seq, name, True, {})) == []
    (p,) = ledger.ack(Ack(cmd.seq, "worker-1", True, {}))
    assert p.ok and set(p.results) == {"scheduler-0", "worker-0", "scheduler-1", "worker-1"}
    cmd, _ = ledger.publish(CommitWeightUpdate("v2"), now=0.0, timeout_s=10)
    for name in ("scheduler-0", "worker-0", "scheduler-1"):
        ledger.ack(Ack(cmd.seq, name, True, {}))
    (p,) = ledger.lose("worker-1")  # engine 1's worker died before it held v2: the commit fails naming it
    assert not p.ok and p.missing == ["worker-1"]


# --- a real `rollbus serve -dp 2` --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    work = tmp_path_factory.mktemp("dp")
    # positions for KILL_TOKENS: a killed engine's streams must still be generating when the kill lands
    folder = tiny_model_with_tokenizer("llama", work / "llama", smollm2_dir, max_position_embeddings=2048)
    s = start_server(work, str(folder), "-dp", "2", "--max-model-len", "2048", "--kv-cache-memory-bytes",
                     "67108864", "--additional-config", RL, "--weight-transfer-config", '{"backend": "ipc"}',
                     "--heartbeat-interval-s", "0.2")
    s.folder = folder
    yield s
    s.stop()


def engine_series(server, name: str) -> dict[str, float]:
    """engine label -> value of one /metrics family (summed over its other labels)."""
    out: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf'{re.escape(name)}\{{(.*)\}} (\S+)$', line)
        if m:
            engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
            out[engine] = out.get(engine, 0.0) + float(m.group(2))
    return out


def test_serve_dp_2_starts_two_engines_and_reports_the_layout(server):
    assert set(server.child_pids()) == {"coordinator", "scheduler-0", "worker-0", "scheduler-1", "worker-1",
                                        "gateway"}
    assert httpx.get(server.url + "/get_world_size", timeout=10).json() == {"world_size": 2}
    assert httpx.get(server.url + "/get_world_size?include_dp=false", timeout=10).json() == {"world_size": 1}
    parallel = httpx.get(server.url + "/server_info?config_format=json", timeout=10).json()
    parallel = parallel.get("vllm_config", parallel).get("parallel_config", {})
    assert parallel.get("data_parallel_size") == 2, parallel


def test_the_header_puts_every_request_on_the_named_engine(server):
    before = engine_series(server, "rollbus_engine_generation_tokens_total")
    for _ in range(6):
        assert completion(server.url, 1).status_code == 200
    after = engine_series(server, "rollbus_engine_generation_tokens_total")  # counted by each scheduler
    assert after.get("1", 0) - before.get("1", 0) == 12 and after.get("0", 0) == before.get("0", 0), after
    success = engine_series(server, "vllm:request_success_total")
    assert success["1"] >= 6 and success.get("0", 0) == 0, success


def test_a_bad_header_is_a_400_naming_it(server):
    for value in ("2", "x"):
        r = httpx.post(server.url + "/v1/completions", headers={HEADER: value}, timeout=10,
                       json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == HEADER, r.text


def test_without_the_header_requests_spread_over_both_engines(server):
    before = engine_series(server, "vllm:request_success_total")
    streams = Streams(server.url, 8, max_tokens=24)
    streams.join(60)
    after = engine_series(server, "vllm:request_success_total")
    gained = {e: after[e] - before.get(e, 0) for e in after}
    assert sum(gained.values()) == 8 and min(gained.values()) >= 1, gained


def test_control_commands_are_acked_by_every_engine(server):
    control = ControlClient(Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}"))
    try:
        reply = control.request(Health())
        assert reply.ok and {"scheduler-0", "scheduler-1", "worker-0", "worker-1"} <= set(reply.results)
        assert {"scheduler-0", "scheduler-1", "worker-0", "worker-1"} <= set(control.request(Members()).results)
    finally:
        control.close()
    try:  # 200 only once every scheduler and worker of both engines acked
        assert httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        assert httpx.get(server.url + "/is_paused", timeout=10).json() == {"is_paused": True}
    finally:
        assert httpx.post(server.url + "/resume", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def trainer(server):
    return perturbed_model(server.folder, 11)


def test_a_weight_update_reaches_every_engine(server, trainer):
    from engine.trainer import WeightSyncClient

    before = greedy(server.url, 0)
    with WeightSyncClient(server.url, backend="ipc") as client:
        client.send_weights(trainer.named_parameters(), version="dp-1", pause="keep")
    sums = checksums(server.url)
    shard = {k.split(":", 4)[4]: v for k, v in sums.items() if k.startswith("dp0:")}
    assert shard and shard == {k.split(":", 4)[4]: v for k, v in sums.items() if k.startswith("dp1:")}
    after = greedy(server.url, 0)
    assert after != before and greedy(server.url, 1) == after
    assert httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"] == "dp-1"


def refused(url: str, engine: int) -> bool:
    """One short probe: is `engine` refused (503) now? A probe sent in the moment between the kill and the
    gateway hearing of it reaches the engine's scheduler, which holds it for the worker's return (issue
    11's recovery): that probe times out (its abort ends it) and counts as "not yet"."""
    try:
        return httpx.post(url + "/v1/completions", timeout=1.0, headers=rank_header(engine),
                          json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}).status_code == 503
    except httpx.TimeoutException:
        return False


def test_a_dead_worker_fails_only_its_engine_and_the_router_avoids_it(server, trainer):
    """SIGKILL worker-1 (engine 1) under streams on both engines: engine 1's fail naming it, engine 0's
    finish; within 5 s requests without the header all land on engine 0; after the launcher restarts it
    (weights from its peer, worker-0) the router uses engine 1 again."""
    url = server.url
    if httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] != "dp-1":  # run alone
        from engine.trainer import WeightSyncClient

        with WeightSyncClient(url, backend="ipc") as client:  # a committed update: the restart needs a peer
            client.send_weights(trainer.named_parameters(), version="dp-1", pause="keep")
    killed, detected = kill_in_engine_1(server, "worker-1", max_tokens=KILL_TOKENS)
    wait_for(lambda: completion(url, 1).status_code == 200, 60, "engine 1 back after the restart", interval_s=0.2)
    print(f"\n-dp 2, SIGKILL worker-1: engine 1 refused after {detected:.2f}s, "
          f"back after {time.monotonic() - killed:.1f}s")
    assert "worker.weights_from_peer" in server.log()
    assert greedy(url, 1) == greedy(url, 0)  # the version in service, from engine 0's worker
    assert_router_uses_engine_1(server)


# Streams the kill must interrupt: the tiny model makes 200 tokens in well under a second, so with 200 a stream
# seen running could be done (its tail still in flight to the client) before the SIGKILL landed (CI, stop 42).
KILL_TOKENS = 2000


def kill_in_engine_1(server, victim: str, max_tokens: int) -> tuple[float, float]:
    """SIGKILL `victim` (a process of engine 1) under streams on engines 0, 1, 0, 1: within 5 s engine 1 is
    refused, requests without the header all land on engine 0, engine 1's streams end in an error naming the
    victim and engine 0's run to the end. (When it was killed, seconds until engine 1 was refused.)"""
    url = server.url
    streams = Streams(url, 4, max_tokens=max_tokens, headers=[rank_header(e) for e in (0, 1, 0, 1)])
    # engine 1's streams must still run when it is killed; on a loaded host engine 0's may already be done
    # by the time engine 1's first tokens come (the checks below hold either way)
    streams.wait_running(must_run=(1, 3))
    os.kill(server.child_pids()[victim], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: refused(url, 1), 5, "engine 1 refused (503) within 5 s")
    detected = time.monotonic() - killed
    before = engine_series(server, "vllm:request_success_total")
    assert all(completion(url).status_code == 200 for _ in range(6))  # balanced requests avoid engine 1
    after = engine_series(server, "vllm:request_success_total")
    # all 6 on engine 0 (engine 0's two streams may finish in this window too: at least 6 there)
    assert after["0"] - before["0"] >= 6 and after["1"] == before["1"], (before, after)
    streams.join(90)  # engine 0's streams run to the end (slow on a loaded machine)
    for i in (1, 3):
        assert '"error"' in streams.lines[i][-2] and victim in streams.lines[i][-2], streams.lines[i][-2:]
    for i in (0, 2):
        assert streams.lines[i][-1] == "data: [DONE]" and '"error"' not in streams.lines[i][-2], streams.lines[i][-2:]
    return killed, detected


def assert_router_uses_engine_1(server) -> None:
    before = engine_series(server, "vllm:request_success_total")
    Streams(server.url, 4, max_tokens=16).join(60)
    after = engine_series(server, "vllm:request_success_total")
    assert after["1"] > before["1"], "the router did not take engine 1 back"


@pytest.mark.skipif(shutil.which("honcho") is None, reason="honcho must be installed (pip install -e '.[test]')")
@pytest.mark.parametrize("procfile, entries", [
    ("Procfile.dp2", {"scheduler1": "scheduler-1", "worker1": "worker-1"}),
    # slow lane (CI time): honcho runs the two-engine Procfile in CI; tests/test_tp_dp.py serves the tp2dp2 layout
    pytest.param("Procfile.tp2dp2", {"scheduler1": "scheduler-1", "worker1": "worker-1", "worker3": "worker-3"},
                 marks=pytest.mark.slow)])
def test_honcho_runs_the_two_engine_procfiles(tmp_path, smollm2_dir, procfile, entries):
    from tests.test_launch import ROOT, wait_healthy

    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    port = free_port()
    env = dict(os.environ, ROLLBUS_ARGS=f"{folder} --port {port} --bus-dir {tmp_path / 'bus'} --max-model-len 256 "
                                        f"--kv-cache-memory-bytes 67108864 --master-port {free_port()}",
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = subprocess.Popen(["honcho", "-f", procfile, "start"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        for engine in (0, 1):
            assert completion(url, engine).status_code == 200
        assert set(engine_series(SimpleNamespace(url=url), "vllm:request_success_total")) == {"0", "1"}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    for entry, member in entries.items():
        assert re.search(rf"^\S+ {entry}\.1\s+\| .*\bproc={member}\b", out, re.M), (entry, out[-3000:])


# tp=1 in the slow lane: tp=2 takes the same per-host addresses and adds the tp group (CI time)
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_two_hosts_on_loopback_addresses_serve_as_one(tmp_path, smollm2_dir, tp):
    """docs/serving.md "Several hosts": "host A" (127.0.0.1) runs the coordinator, the gateway and engine 0,
    "host B" (127.0.0.2) runs engine 1 with the same flags plus its start rank; engine 1's scheduler binds
    on 127.0.0.2 and the gateway reaches it there. With -tp 2 each host's engine forms its own tp group."""
    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    base = free_port_range(16)  # the bus sockets of both engines
    master = free_port_range(2, avoid=range(base, base + 16))  # each engine's tp rendezvous
    flags = [str(folder), "-dp", "2", "-tp", str(tp), "--master-port", str(master),
             "--data-parallel-size-local", "1", "--bus-transport", "tcp", "--bus-host", "127.0.0.1",
             "--bus-engine-hosts", "127.0.0.1,127.0.0.2", "--bus-insecure",
             "--bus-port-base", str(base), "--max-model-len", "256", "--kv-cache-memory-bytes", "67108864",
             "--additional-config", RL, "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 60}']
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start_server(tmp_path / "a", *flags)
    try:
        # host B not up yet: the router keeps to engine 0, a request for engine 1 is a 503 saying why
        assert all(completion(a.url).status_code == 200 for _ in range(4))
        r = completion(a.url, 1)
        assert r.status_code == 503 and "not joined yet" in r.text, r.text
        b = start_server(tmp_path / "b", *flags, "--data-parallel-start-rank", "1")
        try:
            assert set(b.child_pids()) == {"scheduler-1", *(f"worker-{tp + t}" for t in range(tp))}
            assert "engines 1..1 of --data-parallel-size 2" in b.log()
            wait_for(lambda: completion(a.url, 1).status_code == 200, 30, "engine 1 (host B) serving")
            assert completion(a.url, 0).status_code == 200
            assert listening("127.0.0.2", base + 5) and not listening("127.0.0.1", base + 5)  # engine 1's requests
            success = engine_series(a, "vllm:request_success_total")
            assert success["0"] >= 1 and success["1"] >= 1, success
            # the trainer's collective group spans both hosts' workers: trainer rank 0, worker g at rank 1 + g
            assert httpx.get(a.url + "/get_world_size", timeout=10).json() == {"world_size": 2 * tp}
            trainer = perturbed_model(folder, 5)
            with WeightSyncClient(a.url, backend="nccl") as client:
                client.send_weights(trainer.named_parameters(), version="two-hosts", pause="keep")
            named = [(n, t.detach()) for n, t in trainer.named_parameters()]
            shards = {k: v for e in (0, 1) for k, v in shard_checksums(load_hf_config(folder), named, tp,
                                                                         dp_rank=e).items()}
            assert shards.keys() == checksums(a.url).keys()
            r = httpx.post(a.url + "/weight_checker", timeout=30, json={"action": "compare", "baseline": shards})
            assert r.json() == {"match": True, "mismatches": []}, r.text
            assert greedy(a.url, 1) == greedy(a.url, 0)
        finally:
            b.stop()
    finally:
        a.stop()


def listening(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def test_the_coordinator_refuses_an_engine_process_started_with_other_flags(tmp_path):
    """Another host's scheduler with another model or -tp / -dp: refused at Hello naming the value (its
    MemberLink raises BusError and the process exits, so a start-up stops instead of running a broken
    layout); the same layout is welcomed."""
    from bus.member import BusError, MemberLink
    from engine.topology import layout
    from tests.bus_helpers import bus_config, start_coordinator

    cfg = bus_config(tmp_path, data_parallel_size=2)
    proc = start_coordinator(cfg)
    ctx = zmq.Context()
    try:
        ep = Endpoints.from_config(cfg)
        other = layout(bus_config(tmp_path, data_parallel_size=3, model="/models/other"))
        bad = MemberLink(ctx, ep, role="scheduler", name="scheduler-1", info=SchedulerInfo(other),
                         default=lambda c: None)
        with pytest.raises(BusError, match=r"data_parallel_size 3 \(coordinator: 2\)") as e:
            bad.wait_welcome(10)
        assert "model '/models/other'" in str(e.value)
        good = MemberLink(ctx, ep, role="scheduler", name="scheduler-0", info=SchedulerInfo(layout(cfg)),
                          default=lambda c: None)
        good.wait_welcome(10)
        assert good.welcomed
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(10)
