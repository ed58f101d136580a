"""A process's membership on the control bus for poll loops (scheduler, workers, scripts): join with
Hello, follow the coordinator's commands through bus.follower.Follower, send the acks it returns,
heartbeat both ways.

The owning actor registers typed handlers (`link.on(Pause, self._pause)`, see bus.follower), puts
`sockets` in its poller, calls `handle(sock)` when one is readable and `tick(now)` every loop turn.
`link.state` is the control state at the last applied command. A handler that completes later returns
DEFER; the actor then calls `link.complete(result)`.

Rejoin: a member the coordinator declared lost (it stalled past --heartbeat-timeout-s: SIGSTOP, swap, a
starved CPU) reads its own `MemberLost` once it runs again, says Hello again and is welcomed back (the
coordinator then publishes `MemberJoined`); its handlers of both commands decide what the stall cost.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import structlog
import zmq

from bus.codec import CodecError, decode
from bus.control import ACKING_ROLES
from bus.endpoints import COMMAND_TOPIC, Endpoints, presence_topic
from bus.follower import DEFER, Follower, Handler, Refused, SequenceGap  # noqa: F401  (DEFER re-exported)
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    Ack,
    AnyResult,
    Command,
    ControlReply,
    ControlState,
    ErrorInfo,
    ErrorKind,
    Heartbeat,
    Hello,
    MemberLost,
    SchedulerInfo,
    Welcome,
    WorkerInfo,
)
from bus.sockets import make_socket, send

log = structlog.get_logger()


class BusError(RuntimeError):
    """The bus refused us (protocol mismatch) or the coordinator went silent."""


class MemberLink:
    def __init__(self, ctx: zmq.Context, ep: Endpoints, *, role: str, name: str,
                 handlers: dict[type, Handler] | None = None, default: Handler | None = None,
                 info: SchedulerInfo | WorkerInfo | None = None,
                 heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0):
        self.role, self.name, self.info = role, name, info
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.follower = Follower(name, handlers, default=default)
        self.acks = role in ACKING_ROLES
        self.on_reply: Callable[[ControlReply], None] | None = None  # replies to our own ControlRequests
        # Subscribe before saying Hello: the coordinator waits to see our presence topic arrive on its
        # XPUB before it welcomes us, so no command published after the Welcome can miss us.
        self.sub = make_socket(ctx, zmq.SUB, connect=ep.commands)
        self.sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, presence_topic(name))
        self.dealer = make_socket(ctx, zmq.DEALER, connect=ep.control, identity=name)
        now = time.monotonic()
        self._coordinator_seen = now
        self._last_tick = now
        self._command_seq = 0  # the highest seq of a command read on the SUB (coordinator_restarted)
        self._hello()
        self._beat = HeartbeatThread(ctx, ep.control, name, heartbeat_interval_s, lambda: self.follower.seq or 0)

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.sub, self.dealer]

    @property
    def welcomed(self) -> bool:
        return self.follower.welcomed

    @property
    def state(self) -> ControlState:
        return self.follower.state

    @property
    def deferred(self) -> Command | None:
        return self.follower.deferred

    def on(self, command_type: type, handler: Handler) -> None:
        self.follower.on(command_type, handler)

    def wait_welcome(self, timeout_s: float) -> ControlState:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not self.welcomed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BusError(f"{self.name}: no Welcome from the coordinator within {timeout_s:.0f}s")
            for s, _ in poller.poll(left * 1000):
                self.handle(s)
        return self.follower.state

    def handle(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        try:
            msg = decode(frames[1:] if sock is self.sub else frames)
        except CodecError as e:
            log.warning("bus.bad_message", member=self.name, error=str(e))
            return
        self._coordinator_seen = time.monotonic()
        if isinstance(msg, Heartbeat) and coordinator_restarted(msg, self._command_seq):
            # A new coordinator (a supervisor restarted it) starts from the initial control state at seq 0:
            # what we followed is gone. Exit so our supervisor starts us fresh against it.
            raise BusError(f"{self.name}: the coordinator restarted (its seq went back from {self._command_seq} "
                           f"to {msg.seq}); exiting to start again from its state")
        if isinstance(msg, Command) and sock is self.sub:
            self._command_seq = max(self._command_seq, msg.seq)
        if isinstance(msg, Welcome):
            try:
                self._send_acks(self.follower.welcome(msg))
            except Refused as e:
                raise BusError(f"{self.name}: coordinator refused us: {e}") from None
        elif isinstance(msg, ControlReply):
            if self.on_reply is not None:
                self.on_reply(msg)
        elif isinstance(msg, Command):
            if is_own_loss(msg, self.name):
                log.warning("bus.rejoining", member=self.name, why=msg.body.why)
                self._hello()  # the Welcome that answers it is ignored by the follower (same position)
            try:
                acks = self.follower.command(msg)
            except SequenceGap as gap:
                log.warning("bus.sequence_gap", member=self.name, expected=gap.expected, got=gap.got)
                self.follower.resync()  # Clone pattern: drop our position and ask for a fresh snapshot
                self._hello()
                return
            self._send_acks(acks)

    def tick(self, now: float) -> None:
        """Call every loop turn. Raises BusError when the coordinator has been silent too long."""
        if now - self._last_tick > self.interval:
            # We were busy (a long step), not listening: silence over that time proves nothing.
            self._coordinator_seen = max(self._coordinator_seen, now - self.interval)
        self._last_tick = now
        if now - self._coordinator_seen > self.timeout:
            raise BusError(f"{self.name}: coordinator silent for {now - self._coordinator_seen:.1f}s")

    def close(self) -> None:
        self._beat.stop()
        self.sub.close(0)
        self.dealer.close(0)

    def _hello(self) -> None:
        send(self.dealer, Hello(self.role, self.name, os.getpid(), PROTOCOL_VERSION, self.info, PROTOCOL_FINGERPRINT))

    def _send_acks(self, acks: list[Ack]) -> None:
        if not self.acks:
            return
        for a in acks:
            try:
                send(self.dealer, a)
            except CodecError as e:  # a handler returned something the bus cannot carry: fail, not crash
                log.error("bus.unsendable_ack", member=self.name, seq=a.seq, error=str(e))
                send(self.dealer, Ack(a.seq, self.name, False, ErrorInfo(ErrorKind.CODEC, str(e), self.name)))

    def complete(self, result: AnyResult = None, error: ErrorInfo | None = None) -> None:
        """Ack the deferred command, then apply the commands held behind it."""
        self._send_acks(self.follower.complete(result, error))


def coordinator_restarted(beat: Heartbeat, last_command_seq: int) -> bool:
    """The coordinator's heartbeat carries the last seq it published, so on the one SUB pipe it never falls
    below a command that came before it, unless it comes from a new coordinator. (Not compared with the
    Welcome's seq: that travels on another pipe and may overtake older heartbeats.)"""
    return beat.name == "coordinator" and beat.seq < last_command_seq


def is_own_loss(msg: Command, name: str) -> bool:
    """A `MemberLost` naming us: we were declared lost (a stall) and must say Hello again."""
    return isinstance(msg.body, MemberLost) and msg.body.name == name


class HeartbeatThread:
    """Process liveness, independent of the actor's loop: a worker in a long forward pass (or a gateway
    whose event loop parses a huge request) is alive and must not be declared dead. It has its own DEALER
    (sockets are not shared across threads); the coordinator keys heartbeats by the name inside the
    message, not by socket identity. A hung loop (alive but not applying commands) is caught by the
    control deadlines instead."""

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str, interval_s: float, seq: Callable[[], int]):
        self._stop = threading.Event()
        self._args = (ctx, endpoint, name, interval_s, seq)
        self._thread = threading.Thread(target=self._run, name=f"{name}-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx, endpoint, name, interval_s, seq = self._args
        try:
            sock = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=f"{name}.heartbeat")
            while not self._stop.wait(interval_s):
                send(sock, Heartbeat(name, seq()))
            sock.close(0)
        except zmq.ZMQError:
            pass  # the process is tearing its context down: nothing left to keep alive

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
