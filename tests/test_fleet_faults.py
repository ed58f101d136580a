"""Faults in a fleet (docs/fleet.md "Faults"): an engine restarted whole rejoins on the version its workers
last committed (--weights-recovery-resume, engine.fleet.rejoin), or answers 503 naming it, never the
checkpoint; and, marked `fleet` (vllm-router from `bash tests/interop/setup_venvs.sh router`), a worker
killed after a fleet update comes back on the fleet's version or 503 naming it while the other engine keeps
serving and the router sends elsewhere."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from bus.control_state import initial_state
from engine.fleet import rejoin
from engine.fleet.rejoin import FleetRecord, copy_tag, fleet_version, resume_point, starting_state, write_fleet_record
from engine.trainer import WeightSyncClient
from engine.trainer.fleet import commit_failure, verify_body
from tests.router_process import SETUP, router_binary, start_router
from tests.serve_process import free_port
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from tests.test_fleet_weight_sync import checksums_match, perturb, version

RL = '{"rl_config": {"enabled": true}}'


def _copy(path: Path, run_id: str, commits: int, label: str, tensors: dict | None = None) -> None:
    save_file(tensors or {"w": torch.zeros(2)}, str(path),
              metadata={"run_id": run_id, "weight_commits": str(commits), "weight_version": label})


@pytest.mark.unit
def test_the_starting_state_is_the_newest_update_the_copies_hold(tmp_path):
    assert resume_point(str(tmp_path / "absent")) is None and resume_point(str(tmp_path)) is None
    _copy(tmp_path / "worker-0.safetensors", "run-a", 3, "step-3")
    _copy(tmp_path / "worker-1.safetensors", "run-a", 2, "step-2")  # torn: this worker missed update 3
    (tmp_path / "worker-2.safetensors").write_bytes(b"\xff" * 16)  # not a copy: skipped, never a crash
    _copy(tmp_path / "other.safetensors", "run-b", 9, "not-a-copy-name")
    assert copy_tag(str(tmp_path / "worker-2.safetensors")) is None
    assert resume_point(str(tmp_path)) == ("run-a", 3, "step-3")
    s = starting_state("fresh", str(tmp_path), resume=True)
    assert (s.run_id, s.weight_commits, s.weight_version, s.version_labels) == ("run-a", 3, "step-3", {"0": "step-3"})
    assert starting_state("fresh", str(tmp_path), resume=False) == initial_state("fresh")
    assert starting_state("fresh", None, resume=True) == initial_state("fresh")
    empty = tmp_path / "checkpoint"
    empty.mkdir()
    _copy(empty / "worker-0.safetensors", "run-c", 0, "default")  # only the checkpoint's: a fresh start
    assert starting_state("fresh", str(empty), resume=True) == initial_state("fresh")


@pytest.mark.unit
def test_an_engine_that_missed_fleet_updates_starts_lost_on_the_fleets_version(tmp_path, monkeypatch):
    """Its copies hold fleet-1, its record says it committed fleet-1 at t=100 with peer b; b committed fleet-2
    since: the engine starts on fleet-2 as one update past its copies (its workers' restore refuses them and
    report the version lost: 503 naming fleet-2). b silent, or b on fleet-1, or b's update older: it resumes."""
    record = FleetRecord("fleet-1", 100.0, ("http://b:1",))
    assert fleet_version("fleet-1", record, [{"weight_version": "fleet-2", "committed_at": 150.0}]) == "fleet-2"
    assert fleet_version("fleet-1", record, [None, {"weight_version": "fleet-2", "committed_at": 150.0},
                                             {"weight_version": "fleet-3", "committed_at": 160}]) == "fleet-3"
    assert fleet_version("fleet-1", record, [None]) is None
    assert fleet_version("fleet-1", record, [{"weight_version": "fleet-1", "committed_at": 150.0}]) is None
    assert fleet_version("fleet-1", record, [{"weight_version": "old", "committed_at": 90.0}]) is None
    assert fleet_version("fleet-1", record, [{"weight_version": "fleet-2", "committed_at": None}]) is None
    assert fleet_version("solo-2", record, [{"weight_version": "fleet-2", "committed_at": 150.0}]) is None
    assert fleet_version("fleet-1", None, [{"weight_version": "fleet-2", "committed_at": 150.0}]) is None

    _copy(tmp_path / "worker-0.safetensors", "run-a", 3, "fleet-1")
    write_fleet_record(str(tmp_path), record)
    assert rejoin.read_fleet_record(str(tmp_path)) == record
    asked = []
    monkeypatch.setattr(rejoin, "ask_peers", lambda peers, **kw: asked.append(peers) or [
        {"weight_version": "fleet-2", "committed_at": 150.0}])
    s = starting_state("fresh", str(tmp_path), resume=True)
    assert asked == [("http://b:1",)]
    assert (s.run_id, s.weight_commits, s.weight_version, s.version_labels) == ("run-a", 4, "fleet-2", {"0": "fleet-2"})
    monkeypatch.setattr(rejoin, "ask_peers", lambda peers, **kw: [None])  # nobody answers: its own copies
    assert starting_state("fresh", str(tmp_path), resume=True).weight_version == "fleet-1"
    monkeypatch.undo()
    # a peer that refuses the connection answers None, within the timeout
    assert rejoin.ask_peers((f"http://127.0.0.1:{free_port()}",), timeout_s=2) == [None]


@pytest.mark.unit
def test_the_two_phases_wire_and_a_failed_commit_names_who_committed():
    assert verify_body(None) == {"commit": False} and verify_body("v") == {"commit": False, "weight_version": "v"}
    msg = commit_failure([("http://b", RuntimeError("engine http://b: POST /commit_weight_update -> 504: x"))],
                         ["http://a"], "v2")
    assert "engine http://b: POST /commit_weight_update -> 504" in msg and "engines http://a committed v2" in msg
    assert "no engine committed" in commit_failure([("http://b", RuntimeError("down"))], [], None)
    assert "engine http://b: down" in commit_failure([("http://b", RuntimeError("down"))], [], None)


def _completion(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "one two three", "max_tokens": 6, "temperature": 0})


def assert_lost(url: str, model: str, version: str) -> None:
    """The engine's /health turns 503 (within 60 s) and a completion is 503 naming the lost version."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(url + "/health", timeout=10).status_code == 200:
        time.sleep(0.2)
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503, health.text
    r = _completion(url, model)
    assert r.status_code == 503 and f"weight version {version!r} was lost" in r.json()["error"]["message"], r.text


def _kill_engine(server) -> None:
    """SIGKILL the whole `rollbus serve` (as a supervisor sees an engine lost) and wait for its processes."""
    children = list(server.child_pids().values())
    server.proc.kill()
    server.proc.wait(30)
    deadline = time.monotonic() + 30
    for pid in children:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)


@pytest.mark.timeout(420)
def test_a_restarted_engine_rejoins_on_the_committed_version_never_the_checkpoint(tmp_path, smollm2_dir):
    """--weights-recovery-resume: SIGKILL the engine after an update and start it again with the same flags
    (what RollbusServerActor does): it serves the update, bitwise, under its label. With its copy unusable
    it answers 503 naming that version (/health too, so a router stops sending), until a full update."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    args = (str(folder), "--additional-config", RL, "--weight-transfer-config", '{"backend": "ipc"}',
            "--weights-recovery-dir", str(tmp_path / "copies"), "--weights-recovery-resume",
            "--max-model-len", "128", "--block-size", "4")
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = start_server(tmp_path, *args)
    try:
        assert version(s.url) == "default"  # no copies yet: the checkpoint
        checkpoint = httpx.post(s.url + "/weight_checker", json={"action": "checksum"}, timeout=60).json()
        perturb(trainer, seed=7)
        with WeightSyncClient(s.url, backend="ipc") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-7")
        r = _completion(s.url, str(folder))
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        _kill_engine(s)

        s = start_server(tmp_path, *args)
        assert version(s.url) == "fleet-7"
        assert checksums_match(s.url, trainer), "the restarted engine does not serve the committed update"
        now = httpx.post(s.url + "/weight_checker", json={"action": "checksum"}, timeout=60).json()
        assert now != checkpoint
        r = _completion(s.url, str(folder))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
        s.stop()

        copy = tmp_path / "copies" / "worker-0.safetensors"
        tag = copy_tag(str(copy))
        _copy(copy, tag["run_id"], int(tag["weight_commits"]), tag["weight_version"])  # lacks the model's tensors
        s = start_server(tmp_path, *args)
        assert version(s.url) == "fleet-7"
        assert_lost(s.url, str(folder), "fleet-7")

        perturb(trainer, seed=8)  # the next full update serves again
        with WeightSyncClient(s.url, backend="ipc") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-8")
        assert version(s.url) == "fleet-8" and _completion(s.url, str(folder)).status_code == 200
        assert checksums_match(s.url, trainer)
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_down_while_the_fleet_updated_answers_503_naming_the_fleets_version(tmp_path, smollm2_dir):
    """--no-weights-catch-up (catch-up: tests/test_fleet_catch_up.py). Engines a and b take fleet-1 together;
    a is killed; the trainer updates b alone to fleet-2; a, started
    again with its copies (fleet-1), asks b (its fleet record) and answers 503 naming fleet-2, /health 503,
    /weight_info fleet-2: never fleet-1's weights behind the fleet. The trainer's next update of both
    (preflight: both on fleet-2) serves again, bitwise."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    cfg = json.dumps({"backend": "gloo", "timeout_s": 30})

    def engine(name: str):
        return start_server(tmp_path / name, str(folder), "--additional-config", RL, "--weight-transfer-config",
                            cfg, "--weights-recovery-dir", str(tmp_path / name / "copies"),
                            "--weights-recovery-resume", "--no-weights-catch-up", "--max-model-len", "128",
                            "--block-size", "4")

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    a, b = engine("a"), engine("b")
    try:
        perturb(trainer, seed=1)
        with WeightSyncClient([a.url, b.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-1")
        assert rejoin.read_fleet_record(str(tmp_path / "a" / "copies")).peers == (b.url,)
        _kill_engine(a)
        perturb(trainer, seed=2)
        with WeightSyncClient([b.url], backend="gloo") as client:  # the trainer dropped a from its list
            client.send_weights(trainer.named_parameters(), version="fleet-2")
        assert version(b.url) == "fleet-2"

        a = engine("a")  # what its supervisor does: the same flags
        assert version(a.url) == "fleet-2"
        assert_lost(a.url, str(folder), "fleet-2")
        assert _completion(b.url, str(folder)).status_code == 200

        perturb(trainer, seed=3)
        with WeightSyncClient([a.url, b.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-3")
        assert version(a.url) == version(b.url) == "fleet-3"
        assert checksums_match(a.url, trainer) and checksums_match(b.url, trainer)
        ra, rb = _completion(a.url, str(folder)), _completion(b.url, str(folder))
        assert ra.status_code == 200 and ra.json()["choices"][0]["text"] == rb.json()["choices"][0]["text"]
    finally:
        a.stop()
        b.stop()


# ------------------------------------------------------------------------------------- the fleet lane


def _router_health(prometheus_port: int) -> dict[str, float]:
    """vllm_router_worker_health per worker URL (1 healthy, 0 not), from the router's metrics."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm_router_worker_health{"):
            labels, value = line.rsplit(" ", 1)
            url = next((p.split("=", 1)[1].strip('"') for p in labels[labels.index("{") + 1:-1].split(",")
                        if p.startswith("worker=")), None)
            if url:
                out[url] = float(value)
    return out


def _until(cond, timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)
    return time.monotonic() - t0


def _status(url: str, path: str = "/health") -> int:
    try:
        return httpx.get(url + path, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _all_finished(streams) -> None:
    bad = [ls[-2:] for ls in streams.lines if not ls or ls[-1] != "data: [DONE]" or '"error"' in "".join(ls)]
    assert not bad, f"{len(bad)} streams on the other engine were lost: {bad[:2]}"


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_a_worker_killed_after_a_fleet_update(tmp_path, smollm2_dir):
    """Two engines behind vllm-router, one fleet update; then (b, with --weights-recovery-dir) its worker is
    SIGKILLed: back within 90 s on the fleet's version, bitwise, while a's streams finish untouched; then
    a's worker (no copy, no peer) is SIGKILLed: within 90 s it answers 503 naming the version, /health 503,
    the router marks it unhealthy and sends every request to b, b's streams finish untouched; the next
    fleet update serves on both again."""
    from transformers import AutoModelForCausalLM

    from tests.test_recovery import Streams

    if router_binary() is None:
        pytest.skip(f"vllm-router is not installed: {SETUP}")
    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    common = (str(folder), "--additional-config", RL, "--max-model-len", "256", "--block-size", "4",
              "--weight-transfer-config", json.dumps({"backend": "gloo", "timeout_s": 30}))
    a = start_server(tmp_path, *common)
    b = start_server(tmp_path, *common, "--weights-recovery-dir", str(tmp_path / "copies-b"))
    prom = free_port()
    router = None
    try:
        router = start_router(tmp_path, [a.url, b.url], "round_robin", prometheus_port=prom, extra=(
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--health-check-timeout-secs", "3"))
        trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        perturb(trainer, seed=11)
        with WeightSyncClient([a.url, b.url], backend="gloo", timeout_s=60) as client:
            client.send_weights(trainer.named_parameters(), version="fleet-1")
            assert [version(u) for u in (a.url, b.url)] == ["fleet-1", "fleet-1"]

            # b's worker dies; b restores its copy; a serves on
            streams = Streams(a.url, 8, max_tokens=220)
            streams.wait_running()
            os.kill(b.child_pids()["worker-0"], signal.SIGKILL)
            back = _until(lambda: _status(b.url) == 200 and _status(b.url, "/v1/models") == 200, 90,
                          "engine b serving again")
            streams.join(120)
            _all_finished(streams)
            assert version(b.url) == "fleet-1" and checksums_match(b.url, trainer), "b is not on the fleet's version"
            print(f"engine b back on fleet-1 {back:.1f} s after its worker was killed")

            # a's worker dies with no copy: 503 naming the version; the router sends to b
            streams = Streams(b.url, 8, max_tokens=220)
            streams.wait_running()
            os.kill(a.child_pids()["worker-0"], signal.SIGKILL)

            def a_refuses() -> bool:
                r = httpx.post(a.url + "/v1/completions", timeout=30, json={"prompt": [1, 2, 3], "max_tokens": 1})
                return r.status_code == 503 and "weight version 'fleet-1' was lost" in r.text
            lost = _until(a_refuses, 90, "engine a answering 503 naming fleet-1", interval_s=0.5)
            assert _status(a.url) == 503
            _until(lambda: _router_health(prom).get(a.url) == 0.0, 30, "the router marking engine a unhealthy")
            for i in range(12):
                r = httpx.post(router.url + "/v1/completions", timeout=60, json={
                    "model": str(folder), "prompt": f"request {i}", "max_tokens": 2})
                assert r.status_code == 200, f"through the router: {r.status_code} {r.text}"
            streams.join(120)
            _all_finished(streams)
            print(f"engine a answers 503 naming fleet-1 {lost:.1f} s after its worker was killed")

            perturb(trainer, seed=12)  # the next fleet update serves on both
            client.send_weights(trainer.named_parameters(), version="fleet-2")
        assert [version(u) for u in (a.url, b.url)] == ["fleet-2", "fleet-2"]
        assert all(checksums_match(u, trainer) for u in (a.url, b.url))
        assert _status(a.url) == 200
        _until(lambda: _router_health(prom).get(a.url) == 1.0, 30, "the router taking engine a back")
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()
