"""The other ways to run the same processes: honcho with the Procfile, and tcp:// endpoints."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ascend_ops.host_env import cpu_only_host, torch_build_targets
from engine.launcher import launcher_platform
from tests.serve_process import kv_cache_bytes_for_tests
from tests.server_helpers import free_port, free_port_range, start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the launcher exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("never healthy")


def complete(url: str, model: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.skipif(shutil.which("honcho") is None or shutil.which("rollbus") is None,
                    reason="honcho and the rollbus console script must be installed (pip install -e .)")
def test_honcho_runs_the_procfile(tmp_path, smollm2_dir):
    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    port = free_port()
    args = f"{folder} --port {port} --bus-dir {tmp_path / 'bus'} --max-model-len 256"
    kv = kv_cache_bytes_for_tests(args.split())  # as start_server sizes a test's cache: not the CPU default's GiBs
    env = dict(os.environ, ROLLBUS_ARGS=args + ("" if kv is None else f" --kv-cache-memory-bytes {kv}"))
    proc = subprocess.Popen(["honcho", "start"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        assert complete(f"http://127.0.0.1:{port}", str(folder))["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    # each Procfile entry ran its own role: that role's start-up event, in honcho's lines for that entry
    # (honcho prints every entry's name itself, so the names alone prove nothing)
    for entry, event, member in (("coordinator", "coordinator.ready", "coordinator"),
                                 ("scheduler", "scheduler.workers_ready", "scheduler"),
                                 ("worker0", "worker.loaded", "worker-0"), ("gateway", "gateway.serving", "gateway")):
        assert re.search(rf"^\S+ {entry}\.1\s+\| .*{re.escape(event)} .*\bproc={member}\b", out, re.M), \
            (entry, out[-3000:])


def test_tcp_endpoints(tmp_path, smollm2_dir):
    folder = tiny_model_with_tokenizer("qwen2", tmp_path / "qwen2", smollm2_dir)
    base = free_port_range(8)  # base .. base + 4: the bus sockets (bus.topology); outside the ephemeral ports
    # without keys (tests/test_bus_auth.py runs the keyed bus): allowed on loopback only, and said loudly
    s = start_server(tmp_path, str(folder), "--bus-transport", "tcp", "--bus-host", "127.0.0.1",
                     "--bus-port-base", str(base), "--bus-insecure", "--max-model-len", "256")
    try:
        assert complete(s.url, str(folder))["usage"]["completion_tokens"] == 4
        assert f"tcp://127.0.0.1:{base + 4}" in s.log() or f"tcp://127.0.0.1:{base}" in s.log()
        assert "bus.insecure" in s.log()
        if cpu_only_host():  # the launcher checked the layout without torch (ascend_ops.host_env)
            assert "libtorch" not in open(f"/proc/{s.proc.pid}/maps").read()
    finally:
        assert s.stop() == 0


def test_the_launcher_knows_a_cpu_only_host_without_importing_torch():
    import torch

    from ascend_ops.platform import current_platform

    # the file read agrees with what torch says of its own build, and the answer with the workers' platform
    assert torch_build_targets() == {"cuda": torch.version.cuda, "hip": torch.version.hip, "xpu": torch.version.xpu}
    assert launcher_platform() == (current_platform().name, current_platform().device_count())
    assert cpu_only_host({"ROLLBUS_DEVICE": "cpu"}) and not cpu_only_host({"ROLLBUS_DEVICE": "cuda"})
    if not cpu_only_host():
        return  # an accelerator build: only torch can tell, and launcher_platform asked it (above)
    code = ("import sys; from engine.launcher import launcher_platform; "
            "print(launcher_platform(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["('cpu',", "1)", "False"], out.stdout + out.stderr


@pytest.mark.unit
def test_a_signal_wakes_the_launchers_wait_at_once():
    """The launcher waits on its ready socket in 200 ms polls; a stop signal or a child's exit must not wait out
    the poll (the test lane stops ~90 servers): the signal's byte in the wakeup pipe ends the wait at once."""
    import zmq

    from engine.launcher import ReadyWait

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://ready-wait")
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    wait = ReadyWait(sock)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        t0 = time.monotonic()
        assert wait.wait(timeout_ms=20_000) is False  # no message, but the signal ended the wait
        assert time.monotonic() - t0 < 10
        assert wait.wait(timeout_ms=0) is False  # the pipe was drained: no second early wake
        push = ctx.socket(zmq.PUSH)
        push.connect("inproc://ready-wait")
        push.send(b"ready")
        assert wait.wait(timeout_ms=20_000) is True
        push.close(linger=0)
    finally:
        wait.close()
        signal.signal(signal.SIGUSR1, old)
        sock.close(linger=0)
        ctx.term()
    assert signal.set_wakeup_fd(-1) == -1  # close gave back the process's previous wakeup fd (none)
