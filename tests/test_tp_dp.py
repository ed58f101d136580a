"""Tensor x data parallelism: `rollbus serve -tp 2 -dp 2` (4 workers, 2 schedulers) on a tiny Qwen3-MoE, real
processes over CPU Gloo. Both engines compute what a -tp 1 -dp 1 engine does; the world sizes and the parallel
config say 2 x 2; a collective weight update from a trainer of rank 0 (the workers ranks 1 + e x tp + t) reaches
every worker's shard bitwise; pauses and sleep reach every worker; a killed tp worker of engine 1 fails only
engine 1's requests, the router leaves engine 1 until its whole tp group has formed again.

One server for the module (the tests run in order; the kill is last). The -tp 1 reference is started, asked and
stopped before it (the machine has 2 cores).
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from bus.endpoints import Endpoints
from bus.messages import Pause, Resume
from engine.config import parse_config
from engine.trainer.client import WeightSyncClient
from tests.bus_helpers import ControlClient
from tests.test_data_parallel import assert_router_uses_engine_1, kill_in_engine_1
from tests.test_recovery import completion, rank_header
from tests.test_tensor_parallel import (
    PROMPTS,
    assert_same_generation,
    compare,
    generate,
    moe_folder,  # noqa: F401  (the module's tiny Qwen3-MoE fixture)
    perturbed,
    serve,
    tokens_and_logprobs,
    workers_info,
)
from tests.waits import wait_for
from workers.models.checkpoint import iter_safetensors, load_hf_config
from workers.models.registry import shard_checksums

pytestmark = pytest.mark.timeout(600)
WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]
UPDATE_SEED = 3
PEERS = [("worker-0", "worker-2"), ("worker-1", "worker-3")]  # same tp rank in engines 0 and 1: same shard


def test_every_engine_needs_a_rendezvous_port_of_its_own():
    """Engine e's tp group rendezvous on --master-port + e: a last engine beyond port 65535 is refused at
    parsing, naming the values (it would otherwise fail inside its workers' start-up)."""
    assert parse_config(["-tp", "2", "-dp", "2", "--master-port", "65534"]).parallel.master_port == 65534
    with pytest.raises(SystemExit, match=r"--master-port 65535 with --data-parallel-size 2: engine 1's tp group "
                                         r"would rendezvous on port 65536"):
        parse_config(["-tp", "2", "-dp", "2", "--master-port", "65535"])
    assert parse_config(["-dp", "2", "--master-port", "65535"]).parallel.master_port == 65535  # -tp 1: no group


def both_engines(tensors, folder) -> dict[str, str]:
    """The /weight_checker baseline of a -tp 2 -dp 2 deployment holding these HF tensors: every worker's shard
    under vLLM's dp<e>:pp0:pcp0:tp<t> keys."""
    cfg, named = load_hf_config(folder), list(tensors)
    return {k: v for e in (0, 1) for k, v in shard_checksums(cfg, named, 2, dp_rank=e).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, moe_folder):  # noqa: F811
    """What -tp 1 -dp 1 generates for PROMPTS, before and after the update's tensors (sent by ipc)."""
    s = serve(tmp_path_factory.mktemp("ref"), moe_folder, 1, "ipc")
    try:
        out = {"before": [generate(s.url, p) for p in PROMPTS]}
        with WeightSyncClient(s.url, backend="ipc", packed=True, packed_buffer_size_bytes=256 << 10) as c:
            c.send_weights(perturbed(moe_folder, UPDATE_SEED), version="u1", pause="keep")
        out["after"] = [generate(s.url, p) for p in PROMPTS]
    finally:
        s.stop()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, moe_folder, reference):  # noqa: F811
    s = serve(tmp_path_factory.mktemp("tpdp"), moe_folder, 2, "gloo", "-dp", "2", "--enable-sleep-mode",
              "--heartbeat-interval-s", "0.2")
    yield s
    s.stop()


def on_both_engines(url: str) -> list[list[dict]]:
    """Greedy generations of PROMPTS on engine 0 and on engine 1 (named by X-data-parallel-rank)."""
    return [[generate(url, p, headers=rank_header(e)) for p in PROMPTS] for e in (0, 1)]


def assert_identical(a: list, b: list) -> None:
    """The same tokens and bitwise the same logprobs (engines of one layout on one host)."""
    assert [tokens_and_logprobs(g) for g in a] == [tokens_and_logprobs(g) for g in b]


def test_four_workers_two_schedulers_and_the_reported_layout(server):
    assert set(server.child_pids()) == {"coordinator", "scheduler-0", "scheduler-1", *WORKERS, "gateway"}
    assert httpx.get(server.url + "/get_world_size", timeout=10).json() == {"world_size": 4}
    assert httpx.get(server.url + "/get_world_size?include_dp=false", timeout=10).json() == {"world_size": 2}
    pc = httpx.get(server.url + "/server_info?config_format=json", timeout=10).json()["vllm_config"]["parallel_config"]
    assert (pc["tensor_parallel_size"], pc["data_parallel_size"], pc["world_size"], pc["world_size_across_dp"]) == \
        (2, 2, 2, 4)
    workers = workers_info(server.url)
    assert sorted(workers) == WORKERS
    assert [workers[w]["tp_rank"] for w in WORKERS] == [0, 1, 0, 1]
    assert len({(w["weight_bytes"], w["kv_cache_bytes"]) for w in workers.values()}) == 1  # same share each


def test_both_engines_generate_what_tp1_dp1_does(server, reference):
    for engine in on_both_engines(server.url):
        for ref, got in zip(reference["before"], engine):
            assert_same_generation(ref, got)


def test_weight_checker_keys_name_every_worker_of_both_engines(server, moe_folder):  # noqa: F811
    baseline = both_engines(iter_safetensors(moe_folder), moe_folder)
    assert {(k.split(":")[0], k.split(":")[3]) for k in baseline} == {
        ("dp0", "tp0"), ("dp0", "tp1"), ("dp1", "tp0"), ("dp1", "tp1")}
    sums = httpx.post(server.url + "/weight_checker", json={"action": "checksum"}, timeout=120).json()["checksums"]
    assert sums.keys() == baseline.keys()
    assert compare(server.url, baseline) == {"match": True, "mismatches": []}


def test_pauses_and_sleep_reach_every_worker_of_both_engines(server):
    url = server.url
    control = ControlClient(Endpoints.from_url(f"ipc://{server.log_path.parent / f'bus-{server.port}'}"))
    try:
        for mode in ("abort", "keep", "wait"):
            reply = control.request(Pause(mode), timeout_s=30)
            assert reply.ok and {"scheduler-0", "scheduler-1", *WORKERS} <= set(reply.results), (mode, reply)
            assert control.request(Resume(), timeout_s=30).ok
    finally:
        control.close()
    for mode in ("abort", "keep", "wait"):  # and the HTTP routes over the same acks
        assert httpx.post(url + f"/pause?mode={mode}", timeout=60).status_code == 200, mode
        assert httpx.get(url + "/is_paused", timeout=10).json() == {"is_paused": True}
        assert httpx.post(url + "/resume", timeout=60).status_code == 200, mode
    before = on_both_engines(url)
    r = httpx.post(url + "/sleep?level=1", timeout=60)
    assert r.status_code == 200, r.text
    # each of the 4 workers released its KV cache (on CPU level 1 keeps the weights where they are)
    assert r.json()["released_bytes"] == sum(w["kv_cache_bytes"] for w in workers_info(url).values())
    assert httpx.get(url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    r = httpx.post(url + "/wake_up", timeout=60)
    assert r.status_code == 200 and r.json()["restored_bytes"] == sum(
        w["kv_cache_bytes"] for w in workers_info(url).values()), r.text
    for engine_before, engine_after in zip(before, on_both_engines(url)):
        assert_identical(engine_before, engine_after)


def test_a_collective_update_reaches_every_shard_of_both_engines_bitwise(server, reference, moe_folder):  # noqa: F811
    """The trainer is rank 0 of a group of 5 (world size 4 + 1); worker-<g> is rank 1 + g. After it every
    worker's shard equals the trainer's tensor slice bitwise, and both engines generate what -tp 1 does
    with the same tensors."""
    update = perturbed(moe_folder, UPDATE_SEED)
    with WeightSyncClient(server.url, backend="nccl", packed=True, packed_buffer_size_bytes=256 << 10) as c:
        c.send_weights(update, version="u1", pause="abort")
        assert c.sender.group.world_size == 5
        assert compare(server.url, both_engines(update, moe_folder)) == {"match": True, "mismatches": []}
        for engine in on_both_engines(server.url):
            for ref, got in zip(reference["after"], engine):
                assert_same_generation(ref, got)
        second = perturbed(moe_folder, UPDATE_SEED + 1)
        c.send_weights(second, version="u2", pause="keep")  # the same group again
    assert compare(server.url, both_engines(second, moe_folder)) == {"match": True, "mismatches": []}
    zero, one = on_both_engines(server.url)
    assert_identical(zero, one)
    assert httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"] == "u2"


def peer_copies(server) -> list[int]:
    """How many times worker-2 and worker-3 have taken their shard from engine 0's worker of their tp rank."""
    log = server.log()
    return [len(re.findall(rf"worker\.weights_from_peer\s+donor={d} proc={w}\b", log)) for d, w in PEERS]


@pytest.mark.parametrize("victim", ["worker-3", "worker-2"])
def test_a_killed_tp_worker_fails_only_its_engine_whose_tp_group_then_forms_again(server, moe_folder, victim):  # noqa: F811
    """SIGKILL a worker of engine 1 (tp rank 1, then tp rank 0: the one that reports the tokens) under streams
    on both engines: engine 1's streams fail naming it, engine 0's finish; within 5 s engine 1 is refused
    and requests without the header all land on engine 0; engine 1's other worker leaves its broken group,
    the launcher restarts both, they form a new group, take the version in service from their peers of
    engine 0 (same tp rank, same shard), and the router uses engine 1 again."""
    url = server.url
    if httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] != "u2":  # run alone
        with WeightSyncClient(url, backend="nccl", packed=True, packed_buffer_size_bytes=256 << 10) as c:
            c.send_weights(perturbed(moe_folder, UPDATE_SEED + 1), version="u2", pause="keep")
    old = server.child_pids()
    copies = peer_copies(server)
    killed, _ = kill_in_engine_1(server, victim, max_tokens=124)  # all of --max-model-len 128: running when killed
    wait_for(lambda: completion(url, 1).status_code == 200, 90, "engine 1 back after the restart", interval_s=0.2)
    print(f"\n-tp 2 -dp 2, SIGKILL {victim}: engine 1 back after {time.monotonic() - killed:.1f}s")
    new = server.child_pids()
    assert all(new[n] != old[n] for n in ("worker-2", "worker-3")), "engine 1's tp group did not form again"
    assert all(new[n] == old[n] for n in ("scheduler-0", "worker-0", "worker-1", "scheduler-1"))
    assert peer_copies(server) == [n + 1 for n in copies]
    assert compare(url, both_engines(perturbed(moe_folder, UPDATE_SEED + 1), moe_folder)) == {
        "match": True, "mismatches": []}
    # engine 0 would hit its prefix cache (a cached prefill differs from a whole one in the last bits) where
    # restarted engine 1 computes the whole prompt: without caches, bitwise the same
    assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200
    zero, one = on_both_engines(url)
    assert_identical(zero, one)
    assert_router_uses_engine_1(server)
