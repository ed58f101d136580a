"""A process's membership on the control bus (scheduler and workers): join with Hello, apply the
coordinator's commands in order, ack each one, heartbeat both ways.

The owning actor registers `sockets` in its poller, calls `handle(sock)` when one is readable and
`tick(now)` every loop turn. Commands are applied through the `apply` callback the actor passes in; its
return value (a dict) travels back in the Ack, an exception becomes a failed Ack with its message.

A command that completes later (pause in wait mode: ack once the running requests have finished)
returns DEFER; the actor then calls `complete()`. Later commands are held until then, so commands are
still applied, and acked, strictly in order.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import structlog
import zmq

from bus.codec import CodecError, decode
from bus.control import ControlFollower, SequenceGap
from bus.endpoints import COMMAND_TOPIC, Endpoints, presence_topic
from bus.messages import PROTOCOL_VERSION, Ack, Command, Heartbeat, Hello, Welcome
from bus.sockets import make_socket, send

log = structlog.get_logger()


DEFER = object()  # returned by `apply`: the actor acks later through MemberLink.complete()


class BusError(RuntimeError):
    """The bus refused us (protocol mismatch) or the coordinator went silent."""


class MemberLink:
    def __init__(self, ctx: zmq.Context, ep: Endpoints, *, role: str, name: str,
                 apply: Callable[[Command], dict[str, Any] | None], info: dict[str, Any] | None = None,
                 heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0):
        self.role, self.name, self.info = role, name, info or {}
        self.apply = apply
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.follower = ControlFollower()
        self.snapshot: dict[str, Any] = {}
        self.welcomes = 0  # counts snapshots taken (1 at join, +1 per resync): actors refresh their copies
        self.deferred: Command | None = None
        self._held: list[Command] = []
        # Subscribe before saying Hello: the coordinator waits to see our presence topic arrive on its
        # XPUB before it welcomes us, so no command published after the Welcome can miss us.
        self.sub = make_socket(ctx, zmq.SUB, connect=ep.commands)
        self.sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, presence_topic(name))
        self.dealer = make_socket(ctx, zmq.DEALER, connect=ep.control, identity=name)
        now = time.monotonic()
        self._coordinator_seen = now
        self._last_tick = now
        self._hello()
        self._beat = _HeartbeatThread(ctx, ep.control, name, heartbeat_interval_s, lambda: self.follower.seq or 0)

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [self.sub, self.dealer]

    @property
    def welcomed(self) -> bool:
        return self.follower.seq is not None

    def wait_welcome(self, timeout_s: float) -> dict[str, Any]:
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
        return self.snapshot

    def handle(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        try:
            msg = decode(frames[1:] if sock is self.sub else frames)
        except CodecError as e:
            log.warning("bus.bad_message", member=self.name, error=str(e))
            return
        self._coordinator_seen = time.monotonic()
        if isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, Command):
            try:
                ready = self.follower.accept(msg)
            except SequenceGap as gap:
                log.warning("bus.sequence_gap", member=self.name, expected=gap.expected, got=gap.got)
                self._resync()
                return
            self._apply_all(ready)

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
        send(self.dealer, Hello(self.role, self.name, os.getpid(), PROTOCOL_VERSION, self.info))

    def _resync(self) -> None:
        """Clone pattern: drop our position and ask for a fresh snapshot."""
        self.follower = ControlFollower()
        self._hello()

    def _on_welcome(self, w: Welcome) -> None:
        if not w.accepted:
            raise BusError(f"{self.name}: coordinator refused us: {w.reason}")
        self.snapshot = w.snapshot
        self.welcomes += 1
        self._apply_all(self.follower.welcome(w.seq))

    def _apply_all(self, cmds: list[Command]) -> None:
        for cmd in cmds:
            if self.deferred is not None:
                self._held.append(cmd)
                continue
            try:
                result = self.apply(cmd)
            except Exception as e:  # a failed command is reported, never fatal to the member
                log.exception("bus.command_failed", member=self.name, command=cmd.command)
                # An error that knows its HTTP status (e.g. a 400 for bad weight metadata) passes it on.
                status, param = getattr(e, "status", None), getattr(e, "param", None)
                extra = {"error_status": status, "error_param": param} if isinstance(status, int) else {}
                send(self.dealer, Ack(cmd.seq, self.name, False, f"{type(e).__name__}: {e}", extra))
                continue
            if result is DEFER:
                self.deferred = cmd
            else:
                send(self.dealer, Ack(cmd.seq, self.name, True, "", result or {}))

    def complete(self, result: dict[str, Any] | None = None, error: str = "") -> None:
        """Ack the deferred command, then apply the commands held behind it."""
        cmd, self.deferred = self.deferred, None
        if cmd is None:
            return
        send(self.dealer, Ack(cmd.seq, self.name, not error, error, result or {}))
        held, self._held = self._held, []
        self._apply_all(held)


class _HeartbeatThread:
    """Process liveness, independent of the actor's loop: a worker in a long forward pass is alive and
    must not be declared dead. It has its own DEALER (sockets are not shared across threads); the
    coordinator keys heartbeats by the name inside the message, not by socket identity. A hung loop
    (alive but not applying commands) is caught by the control deadlines instead."""

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
