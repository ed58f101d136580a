"""Processes joining and leaving a running engine (as under honcho, where nothing waits for anyone)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine.config import EngineConfig
from tests.server_helpers import free_port, metric, sized_for_tests
from tests.waits import holds, wait_for

pytestmark = pytest.mark.timeout(180)

FAKE_GATEWAY = """
import sys, time, zmq
from bus.endpoints import Endpoints
from bus.member import MemberLink
from bus.messages import AddRequest
from bus.sampling_params import SamplingParams
from bus.sockets import make_socket, send
from engine.config import parse_config
ep = Endpoints.from_config(parse_config(sys.argv[1:]))
ctx = zmq.Context()
link = MemberLink(ctx, ep, role="gateway", name="gateway-fake", default=lambda c: None, heartbeat_interval_s=0.2)
link.wait_welcome(30)
req = make_socket(ctx, zmq.DEALER, connect=ep.requests, identity="gateway-fake")
send(req, AddRequest("orphan", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True), [0], time.time()))
assert req.poll(30000), "the scheduler never answered"  # the request is running, not just queued here
print("sent", flush=True)
while True:
    for s in link.sockets:
        while s.poll(0):
            link.handle(s)
    link.tick(time.monotonic())
    time.sleep(0.05)
"""


def role(cfg_argv, *role_argv, log=None):
    return subprocess.Popen([sys.executable, "-m", "engine.cli", *role_argv, *cfg_argv], stderr=log)


def health(url):
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return None


def wait_status(url, want, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if health(url) == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"/health never returned {want}")


def test_health_waits_for_workers_and_a_lost_gateway_only_costs_its_own_requests(tmp_path, smollm2_dir):
    # the real model: its orphan request must still be running when its gateway is declared lost
    folder = smollm2_dir
    cfg = sized_for_tests(EngineConfig.from_flags(model=str(folder), port=free_port(), bus_dir=str(tmp_path / "bus"),
                                       max_model_len=2048, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5))
    argv = cfg.to_argv()
    url = f"http://127.0.0.1:{cfg.gateway.port}"
    sched_log = open(tmp_path / "scheduler.log", "w")
    procs = [role(argv, "coordinator"), role(argv, "scheduler", log=sched_log), role(argv, "gateway")]
    fake = None
    try:
        wait_status(url, 503)  # gateway up, no worker yet: not ready
        procs.append(role(argv, "worker", "--rank", "0"))
        wait_status(url, 200)
        fake = subprocess.Popen([sys.executable, "-c", FAKE_GATEWAY, *argv], stdout=subprocess.PIPE, text=True)
        assert fake.stdout.readline().strip() == "sent"
        fake.send_signal(signal.SIGKILL)
        fake.wait()
        # past the heartbeat timeout the coordinator declares gateway-fake lost and the scheduler aborts its orphan
        wait_for(lambda: "scheduler.aborted_orphans" in (tmp_path / "scheduler.log").read_text(), 30,
                 "the orphan's abort")
        # our gateway is unaffected by another gateway's death, and the orphan no longer runs
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": str(folder), "prompt": [4, 5], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert health(url) == 200
        assert metric_running(url) == 0
        log = (tmp_path / "scheduler.log").read_text()
        assert "scheduler.aborted_orphans" in log and "gateway-fake" in log, log[-2000:]
    finally:
        for p in procs + ([fake] if fake else []):
            p.terminate()
        for p in procs:
            p.wait(10)


def metric_running(url):
    class S:  # metric() takes a server-like object
        pass

    s = S()
    s.url = url
    return metric(s, "vllm:num_requests_running")


def test_a_late_worker_and_scheduler_start_from_the_current_control_state(tmp_path, smollm2_dir):
    """Commands broadcast before the worker exists (a version change, a keep pause) are in force when
    it joins: served tokens carry the version, the pause holds until /resume."""
    from tests.server_helpers import tiny_model_with_tokenizer

    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    cfg = sized_for_tests(EngineConfig.from_flags(model=str(folder), port=free_port(), bus_dir=str(tmp_path / "bus"),
                                       max_model_len=256, additional_config='{"rl_config": {"enabled": true}}'))
    argv = cfg.to_argv()
    url = f"http://127.0.0.1:{cfg.gateway.port}"
    procs = [role(argv, "coordinator"), role(argv, "scheduler"), role(argv, "gateway")]
    try:
        wait_status(url, 503)
        assert httpx.post(url + "/update_weight_version", json={"new_version": "v5"}, timeout=30).status_code == 200
        assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        procs.append(role(argv, "worker", "--rank", "0"))
        wait_status(url, 200)
        assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
        got: dict = {}

        def go():
            got.update(httpx.post(url + "/v1/completions", timeout=60, json={
                "model": str(folder), "prompt": [4, 5], "max_tokens": 3, "ignore_eos": True,
                "return_weight_versions": True}).json())

        import threading

        t = threading.Thread(target=go)
        t.start()
        holds(lambda: not got, 1.0, "kept: queued, not served")  # no event says the request was queued
        assert httpx.post(url + "/resume", timeout=30).status_code == 200
        t.join(60)
        assert got["choices"][0]["weight_versions"] == [{"version": "v5", "start": 0, "end": 3}]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
