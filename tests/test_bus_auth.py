"""The tcp bus is authenticated (bus.auth): CURVE on every tcp socket, only allowed client keys get in,
sockets bind --bus-host only; tcp without keys needs --bus-insecure on loopback; ipc sockets are
owner-only. One real `rollbus serve` over tcp with keys from `rollbus keys`, loopback only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from bus import auth
from bus.codec import encode
from bus.control_client import ControlClient
from bus.endpoints import Endpoints, private_folder
from bus.messages import (
    AddRequest,
    ControlReply,
    ControlRequest,
    Health,
    Members,
    Pause,
    SamplingParams,
    Sleep,
    UpdateWeights,
    WeightUpdateEvent,
)
from bus.sockets import make_socket
from engine.config import EngineConfig, parse_config
from tests.server_helpers import free_port_range, start_server, tiny_model_with_tokenizer
from tests.waits import wait_subscribed

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SILENCE_S = 3.0  # the coordinator heartbeats every 0.5 s on the commands socket: 6 beats an outsider must miss


def rollbus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("curve") / "keys"
    r = rollbus("keys", str(folder))
    assert r.returncode == 0, r.stderr
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir, keys):
    work = tmp_path_factory.mktemp("tcpbus")
    model = tiny_model_with_tokenizer("qwen2", work / "qwen2", smollm2_dir)
    base = free_port_range(8)  # base .. base + 4: the bus sockets (bus.topology); outside the ephemeral ports
    s = start_server(work, str(model), "--bus-transport", "tcp", "--bus-host", "127.0.0.1",
                     "--bus-port-base", str(base), "--bus-curve-dir", str(keys), "--max-model-len", "128",
                     "--enable-sleep-mode", "--additional-config", '{"rl_config": {"enabled": true}}',
                     "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 20}')
    s.base, s.model = base, model
    yield s
    assert s.stop() == 0


def bus_url(server) -> str:
    return f"tcp://127.0.0.1:{server.base}"


def engine_seq(server, keys) -> int:
    """The coordinator's command seq, through an authenticated client (broadcasting one Health)."""
    c = ControlClient(Endpoints.from_url(bus_url(server), curve_dir=str(keys)))
    try:
        reply = c.request(Health(), 10)
        assert reply.ok, reply
        return reply.seq
    finally:
        c.close()


# ---------------------------------------------------------------------------------------- keys


def test_rollbus_keys_writes_private_usable_keys(keys):
    names = sorted(os.listdir(keys))
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert mode(keys) == 0o700 and all(mode(keys / n) == 0o600 for n in names)
    k = auth.load(str(keys), server=True)
    assert k.server_secret is not None and k.client_public in k.allowed and k.server_public not in k.allowed
    r = rollbus("keys", str(keys))  # never overwritten by accident
    assert r.returncode != 0 and "server.key exists" in r.stderr and "--force" in r.stderr


def test_help_explains_the_bus_flags_and_the_keys_command():
    r = rollbus("serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for words in ("--bus-curve-dir", "rollbus keys DIR", "--bus-insecure", "Only with a loopback --bus-host"):
        assert words in text, words
    assert "keys" in rollbus("--help").stdout
    r = rollbus("keys", "--help")
    assert r.returncode == 0 and "--force" in r.stdout and "0600" in r.stdout


@pytest.mark.unit
@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "client.key_secret").write_text("not a certificate\n"), "client.key_secret"),
    (lambda d: (d / "server.key_secret").write_text('metadata\ncurve\n    public-key = "short"\n'
                                                  '    secret-key = "short"\n'), "server.key_secret"),
    (lambda d: os.chmod(d / "client.key_secret", 0o644), "readable by other users"),
    (lambda d: os.unlink(d / "server.key_secret"), "server.key_secret does not exist"),
])
def test_bad_key_files_stop_the_start_up_naming_the_file(tmp_path, damage, words):
    folder = tmp_path / "k"
    auth.generate(str(folder))
    damage(folder)
    with pytest.raises(SystemExit, match=words):
        parse_config(["m", "--bus-transport", "tcp", "--bus-curve-dir", str(folder)])


def test_rollbus_serve_reports_a_bad_key_file_and_exits(tmp_path):
    folder = tmp_path / "k"
    auth.generate(str(folder))
    (folder / "client.key_secret").write_text("garbage")
    r = rollbus("serve", "m", "--bus-transport", "tcp", "--bus-curve-dir", str(folder))
    assert r.returncode != 0 and str(folder / "client.key_secret") in r.stderr, r.stderr


@pytest.mark.unit
def test_bus_dir_with_a_tcp_bus_is_refused_by_name(monkeypatch):
    """--bus-dir places ipc sockets; with tcp it would be accepted and do nothing."""
    monkeypatch.delenv("ROLLBUS_BUS_DIR", raising=False)
    with pytest.raises(SystemExit, match="--bus-dir"):
        parse_config(["m", "--bus-transport", "tcp", "--bus-insecure", "--bus-dir", "/tmp/x"])
    assert parse_config(["m", "--bus-dir", "/tmp/x"]).bus.bus_dir == "/tmp/x"


def test_tcp_without_keys_is_refused_unless_insecure_on_loopback(tmp_path):
    with pytest.raises(SystemExit, match="rollbus keys DIR"):
        parse_config(["m", "--bus-transport", "tcp"])
    with pytest.raises(SystemExit, match="--bus-insecure is refused with --bus-host 10.0.0.1"):
        parse_config(["m", "--bus-transport", "tcp", "--bus-host", "10.0.0.1", "--bus-insecure"])
    assert parse_config(["m", "--bus-transport", "tcp", "--bus-insecure"]).bus.bus_insecure
    assert parse_config(["m", "--bus-transport", "tcp", "--bus-host", "::1", "--bus-insecure"]).bus.bus_insecure
    with pytest.raises(SystemExit, match="tcp only"):
        parse_config(["m", "--bus-insecure"])
    auth.generate(str(tmp_path / "k"))
    with pytest.raises(SystemExit, match="contradict"):
        parse_config(["m", "--bus-transport", "tcp", "--bus-insecure", "--bus-curve-dir", str(tmp_path / "k")])
    # clients too: a tcp bus url needs the client keys (or insecure=True)
    env = os.environ.pop(auth.ENV_DIR, None)
    try:
        with pytest.raises(ValueError, match=auth.ENV_DIR):
            Endpoints.from_url("tcp://127.0.0.1:5550", insecure=False)
    finally:
        if env is not None:
            os.environ[auth.ENV_DIR] = env
    assert Endpoints.from_url("tcp://127.0.0.1:5550", insecure=True).keys is None
    ipv6 = Endpoints.from_config(parse_config(["m", "--bus-transport", "tcp", "--bus-host", "::1", "--bus-insecure"]))
    assert ipv6.control == "tcp://[::1]:5553" == Endpoints.from_url("tcp://[::1]:5550", insecure=True).control
    assert Endpoints.from_url("tcp://127.0.0.1:5550", curve_dir=str(tmp_path / "k")).keys.server_secret is None


# ---------------------------------------------------------------------------------------- ipc


@pytest.mark.unit
def test_ipc_folder_is_0700_and_its_sockets_owner_only(tmp_path):
    ep = Endpoints.from_config(EngineConfig.from_flags(bus_transport="ipc", bus_dir=str(tmp_path / "bus"), port=0))
    assert mode(tmp_path / "bus") == 0o700
    ctx = zmq.Context()
    try:
        make_socket(ctx, zmq.ROUTER, bind=ep.control)
        assert mode(tmp_path / "bus" / "control") == 0o600
    finally:
        ctx.destroy(linger=0)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match=f"bus folder {open_dir} .*open to other users"):
        private_folder(str(open_dir))


# ---------------------------------------------------------------------------------------- a real engine


def test_bus_sockets_bind_the_bus_host_only(server):
    listening = {}
    for role, pid in server.child_pids().items():
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and server.base <= c.laddr.port < server.base + 5:
                listening[c.laddr.port] = (role, c.laddr.ip)
    assert sorted(listening) == list(range(server.base, server.base + 5)), listening
    assert {ip for _, ip in listening.values()} == {"127.0.0.1"}, listening  # not 0.0.0.0


def outsider_sockets(ctx: zmq.Context, server, client_keys: auth.BusKeys | None):
    """A DEALER on control and requests and a SUB on commands and plans, plain or with other keys."""
    if client_keys is not None:
        auth.attach(ctx, client_keys)
    socks = {}
    for name, kind, off in (("control", zmq.DEALER, 3), ("requests", zmq.DEALER, 0),
                            ("commands", zmq.SUB, 4), ("plans", zmq.SUB, 1)):
        socks[name] = make_socket(ctx, kind, connect=f"tcp://127.0.0.1:{server.base + off}")
        if kind == zmq.SUB:
            socks[name].setsockopt(zmq.SUBSCRIBE, b"")
    return socks


def attack(socks) -> None:
    """Send what would pause, sleep, update or run a request. Without a completed handshake a socket may
    have no pipe to queue on: a send that would block is the refusal itself, not an error of the test."""
    rid = uuid.uuid4().hex
    msgs = [("control", ControlRequest(rid, body, 5.0))
            for body in (Members(), Pause("keep"), Sleep(level=1), UpdateWeights({"names": []}))]
    msgs.append(("control", WeightUpdateEvent(rid, "evil", "keep", True, [], 5.0)))
    msgs.append(("requests", AddRequest(rid, [5, 6, 7], SamplingParams(max_tokens=4), [], time.time())))
    for where, msg in msgs:
        try:
            socks[where].send_multipart(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_peer_without_the_key_gets_nothing_and_cannot_pause_sleep_or_update(server, keys, tmp_path, who):
    other = None
    if who == "another key":  # a pair of its own that pins the real server key
        auth.generate(str(tmp_path / "other"))
        mine = auth.load(str(tmp_path / "other"), server=False)
        other = auth.BusKeys(auth.load(str(keys), server=False).server_public, mine.client_public,
                             mine.client_secret)
    seq = engine_seq(server, keys)
    version = httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"]
    ctx = zmq.Context()
    # an authenticated subscriber at the same time: the coordinator is publishing all along
    insider_ctx = zmq.Context()
    try:
        socks = outsider_sockets(ctx, server, other)
        iep = Endpoints.from_url(bus_url(server), curve_dir=str(keys)).secure(insider_ctx)
        insider = make_socket(insider_ctx, zmq.SUB, connect=iep.commands)
        wait_subscribed(insider)
        attack(socks)
        poller = zmq.Poller()
        for s in socks.values():
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + SILENCE_S
        while (left := deadline - time.monotonic()) > 0:
            got = poller.poll(left * 1000)
            assert not got, f"{who}: the outsider received {[s.recv_multipart() for s, _ in got]}"
        assert insider.poll(1000), "the authenticated subscriber heard nothing in the same window"
    finally:
        ctx.destroy(linger=0)
        insider_ctx.destroy(linger=0)
    # nothing the outsider sent was broadcast: exactly one command (our Health) since the last seq
    assert engine_seq(server, keys) == seq + 1
    assert httpx.get(server.url + "/is_paused", timeout=10).json() == {"is_paused": False}
    assert httpx.get(server.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"] == version
    if who == "another key":
        assert "bus.peer_refused" in server.log()


def test_a_peer_with_the_client_key_gets_the_members_and_updates_the_weights(server, keys):
    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient

    c = ControlClient(Endpoints.from_url(bus_url(server), curve_dir=str(keys)))
    try:
        reply = c.request(Members(), 10)
    finally:
        c.close()
    assert isinstance(reply, ControlReply) and reply.ok
    roles = {m.role for m in reply.results.values()}
    assert {"scheduler", "worker", "gateway"} <= roles and "worker-0" in reply.results, reply.results
    trainer = AutoModelForCausalLM.from_pretrained(server.model).eval()
    with WeightSyncClient(None, backend="ipc", bus=bus_url(server), bus_curve_dir=str(keys)) as client:
        client.send_weights(trainer.named_parameters(), version="over-curve", pause="keep")
    assert httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"] == "over-curve"
    r = httpx.post(server.url + "/v1/completions", json={"model": str(server.model), "prompt": [5, 6, 7],
                                                          "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
