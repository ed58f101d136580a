"""The control bus over real sockets with a real coordinator process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from bus.codec import decode
from bus.endpoints import COMMAND_TOPIC, Endpoints
from bus.follower import Follower, SequenceGap
from bus.member import BusError, MemberLink
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    Command,
    ControlState,
    Health,
    Hello,
    Pause,
    Resume,
    Welcome,
)
from bus.sockets import make_socket, send
from tests.bus_helpers import ControlClient, MemberThread, bus_config, start_coordinator, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def bus(tmp_path):
    cfg = bus_config(tmp_path)
    proc = start_coordinator(cfg)
    ep = Endpoints.from_config(cfg)
    client = ControlClient(ep)
    members: list[MemberThread] = []
    yield cfg, ep, client, members
    for m in members:
        m.close()
    client.close()
    proc.terminate()
    proc.wait(10)


def join(ep, members, name, **kw):
    m = MemberThread(ep, name, **kw)
    members.append(m)
    assert m.welcomed.wait(10), f"{name} was not welcomed"
    return m


def test_broadcast_is_acked_by_every_member_in_order(bus):
    cfg, ep, client, members = bus
    ms = [join(ep, members, f"worker-{i}") for i in range(3)] + [join(ep, members, "scheduler", role="scheduler")]
    for _ in range(5):
        reply = client.request(Health())
        assert reply.ok, reply.error
        assert set(reply.results) == {m.name for m in ms}
    health = [[(s, c) for s, c in m.applied if c == "health"] for m in ms]  # member_joined's of later joiners too
    seqs = [s for s, _ in health[0]]
    assert seqs == sorted(seqs) and len(seqs) == 5
    assert all(h == health[0] for h in health)


def test_late_joiners_never_miss_a_command(bus):
    """Join and command back to back, many times: no sleeps anywhere, every command acked by all."""
    cfg, ep, client, members = bus
    join(ep, members, "worker-0")
    for i in range(1, 15):
        join(ep, members, f"worker-{i}")
        reply = client.request(Health())
        assert reply.ok, reply.error
        assert len(reply.results) == i + 1
    first_seq_of = {m.name: m.applied[0][0] for m in members}
    # each member applied every command published after its Welcome, with no holes
    for m in members:
        seqs = [s for s, _ in m.applied]
        assert seqs == list(range(first_seq_of[m.name], first_seq_of[m.name] + len(seqs)))


def test_a_failed_apply_is_reported_by_name(bus):
    cfg, ep, client, members = bus

    def boom(cmd):
        raise RuntimeError("cannot do that")

    join(ep, members, "worker-0")
    join(ep, members, "worker-1", apply=boom)
    reply = client.request(Health())
    assert not reply.ok and "worker-1" in reply.error and "cannot do that" in reply.error


def test_dead_member_is_noticed_and_named(bus, tmp_path):
    cfg, ep, client, members = bus
    join(ep, members, "worker-0")
    watcher = join(ep, members, "scheduler", role="scheduler")
    # A real member process that we SIGKILL.
    proc = subprocess.Popen([sys.executable, "-c", f"""
import time, zmq
from bus.endpoints import Endpoints
from engine.config import EngineConfig
from bus.member import MemberLink
cfg = EngineConfig.from_flags(bus_dir={str(tmp_path)!r})
link = MemberLink(zmq.Context(), Endpoints.from_config(cfg), role="worker", name="worker-9", default=lambda c: None,
                  heartbeat_interval_s=0.2)
link.wait_welcome(10)
print("joined", flush=True)
while True:
    for s, _ in zmq.Poller().poll(0): pass
    for s in link.sockets:
        while s.poll(0): link.handle(s)
    link.tick(time.monotonic()); time.sleep(0.05)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "joined"
        assert client.request(Health()).ok
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_for(lambda: any(c == "member_lost" for _, c in watcher.applied), 5, "member_lost")
        assert time.monotonic() - t0 < 5
        reply = client.request(Health())
        assert reply.ok and "worker-9" not in reply.results  # the survivors keep working
    finally:
        proc.kill()


def test_silent_member_misses_the_deadline_and_is_named(tmp_path):
    """A member that stops reading (hung, not dead) makes the command fail naming it."""
    cfg = bus_config(tmp_path, heartbeat_timeout_s=30.0, control_timeout_s=1.0)
    proc = start_coordinator(cfg)
    ep = Endpoints.from_config(cfg)
    client = ControlClient(ep)
    m = MemberThread(ep, "worker-0", timeout=60)
    try:
        assert m.welcomed.wait(10)
        hung_ctx = zmq.Context()
        hung = MemberLink(hung_ctx, ep, role="worker", name="worker-1", default=lambda c: None)
        hung.wait_welcome(10)  # joined, then never reads again
        reply = client.request(Health(), timeout_s=1.0)
        assert not reply.ok and reply.missing == ["worker-1"] and "worker-1" in reply.error
        hung_ctx.destroy(linger=0)
    finally:
        m.close()
        client.close()
        proc.terminate()
        proc.wait(10)


def test_protocol_version_mismatch_is_refused(bus):
    cfg, ep, client, members = bus
    ctx = zmq.Context()
    try:
        sub = make_socket(ctx, zmq.SUB, connect=ep.commands)
        sub.setsockopt(zmq.SUBSCRIBE, b"@old-worker")
        dealer = make_socket(ctx, zmq.DEALER, connect=ep.control, identity="old-worker")
        send(dealer, Hello("worker", "old-worker", os.getpid(), 999, {}))
        assert dealer.poll(5000)
        w = decode(dealer.recv_multipart())
        assert isinstance(w, Welcome) and not w.accepted and "999" in w.reason
        # the same version number with other struct definitions (someone forgot to bump it): refused too
        send(dealer, Hello("worker", "old-worker", os.getpid(), PROTOCOL_VERSION, {}, "0123456789ab"))
        assert dealer.poll(5000)
        w = decode(dealer.recv_multipart())
        assert isinstance(w, Welcome) and not w.accepted and "0123456789ab" in w.reason
        # a version-11 peer (its Hello.info was a dict): refused at Hello, the reason naming both versions
        dealer.send_multipart([bytes([Hello.KIND]) + msgspec.msgpack.encode(
            ["worker", "old-worker", os.getpid(), 11, {"num_blocks": 4}, "22a06d03303c"])])
        assert dealer.poll(5000)
        w = decode(dealer.recv_multipart())
        assert isinstance(w, Welcome) and not w.accepted
        assert f"protocol version 11 (22a06d03303c) != coordinator's {PROTOCOL_VERSION} ({PROTOCOL_FINGERPRINT})" \
            in w.reason, w.reason
    finally:
        ctx.destroy(linger=0)


def test_member_link_raises_on_refusal(tmp_path, monkeypatch):
    cfg = bus_config(tmp_path)
    proc = start_coordinator(cfg)
    ctx = zmq.Context()
    try:
        import bus.member as member

        monkeypatch.setattr(member, "PROTOCOL_VERSION", 999)
        link = MemberLink(ctx, Endpoints.from_config(cfg), role="worker", name="w", default=lambda c: None)
        with pytest.raises(BusError, match="refused"):
            link.wait_welcome(10)
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(10)


def test_sequence_gap_is_detected_and_resynced(tmp_path):
    """A fake coordinator skips seq 2: the member must notice and ask for a fresh snapshot (re-Hello)."""
    ep = Endpoints.from_config(bus_config(tmp_path))
    ctx = zmq.Context()
    try:
        router = make_socket(ctx, zmq.ROUTER, bind=ep.control)
        pub = make_socket(ctx, zmq.XPUB, bind=ep.commands)
        m = MemberThread(ep, "worker-0", timeout=30)
        frames = router.recv_multipart()
        assert isinstance(decode(frames[1:]), Hello)
        assert pub.poll(5000)  # wait for a subscription (presence or commands), not a sleep
        while pub.poll(200):
            pub.recv()
        send(router, Welcome(True, "", 0, ControlState()), to=b"worker-0")
        assert m.welcomed.wait(5)
        send(pub, Command(1, Health()), topic=COMMAND_TOPIC)
        send(pub, Command(3, Health()), topic=COMMAND_TOPIC)
        hellos = 0
        deadline = time.monotonic() + 5
        while hellos == 0 and time.monotonic() < deadline:
            if router.poll(100):
                msg = decode(router.recv_multipart()[1:])
                hellos += isinstance(msg, Hello)
        assert hellos == 1, "member did not resync after the gap"
        assert m.applied == [(1, "health")]  # seq 3 was not applied out of order
        m.close()
    finally:
        ctx.destroy(linger=0)


def test_follower_orders_early_commands_and_detects_gaps():
    seen = []
    f = Follower("w", default=lambda body: seen.append(f.current.seq))
    assert f.command(Command(6, Resume())) == []  # before Welcome: buffered
    assert f.command(Command(5, Pause("keep", False))) == []
    acks = f.welcome(Welcome(True, "", 4, ControlState()))
    assert [a.seq for a in acks] == [5, 6] and seen == [5, 6]
    assert f.state.paused is None and f.before.paused.mode == "keep"  # reduced in order: pause, then resume
    assert f.command(Command(6, Resume())) == []  # duplicate
    with pytest.raises(SequenceGap):
        f.command(Command(8, Health()))


def test_a_stale_welcome_never_rolls_back_applied_commands():
    f = Follower("gateway-0")
    f.welcome(Welcome(True, "", 2, ControlState()))
    f.command(Command(3, Pause("keep", False)))
    assert f.welcome(Welcome(True, "", 2, ControlState())) == [] and f.seq == 3  # a late duplicate
    assert f.state.paused.mode == "keep"
    f.resync()  # after a gap: the next Welcome is the truth
    f.welcome(Welcome(True, "", 5, ControlState()))
    assert f.seq == 5 and f.state.paused is None and f.welcomes == 2


def test_a_failing_handler_acks_a_typed_error():
    from engine.weights.protocol import WeightSyncError

    def refuse(cmd):
        raise WeightSyncError("tensor 'w' has the wrong shape", status=400, param="shapes")

    f = Follower("worker-3", {Pause: refuse, Resume: lambda c: 7})
    f.welcome(Welcome(True, "", 0, ControlState()))
    (ack,) = f.command(Command(1, Pause("keep")))
    assert not ack.ok and ack.error.kind == "WeightSyncError" and ack.error.status == 400
    assert ack.error.param == "shapes" and ack.error.member == "worker-3"
    assert ack.error.text() == "worker-3: tensor 'w' has the wrong shape"  # a status: no kind in the text
    (ack,) = f.command(Command(2, Resume()))  # a result that is not the command's is a failure, not a lost ack
    assert not ack.ok and "not one of its results" in ack.error.message
    (ack,) = f.command(Command(3, Health()))  # no handler: acked, empty
    assert ack.ok and ack.result is None
