"""Waiting in tests without sleeping to synchronise: poll a condition with a deadline, watch that a
condition keeps holding (only where no event can prove progress), and know when a SUB socket's topics
are in force at the coordinator's publisher."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from bus.endpoints import COMMAND_TOPIC

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", interval_s: float = 0.02) -> T:
    """Poll `pred` until it returns something truthy (returned) or fail after `timeout_s`, naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(interval_s)


def holds(pred: Callable[[], object], for_s: float, what: str, interval_s: float = 0.02) -> None:
    """Assert `pred` is true at every poll for `for_s` seconds, failing the moment it is not. For "X does
    not happen" where nothing observable proves the engine had its chance to do X; prefer an event."""
    deadline = time.monotonic() + for_s
    while True:
        assert pred(), f"{what} stopped holding"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)


def wait_subscribed(sub: zmq.Socket, timeout_s: float = 10.0) -> None:
    """Return once every topic `sub` subscribed to so far is in force at the coordinator's commands XPUB.
    Subscriptions travel to the publisher in order on one pipe, so subscribing to the coordinator's
    heartbeats last and receiving one proves the earlier ones arrived. `sub` stays subscribed to the
    command topic: read it with recv_topic."""
    sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(left * 1000), "no heartbeat from the coordinator: not subscribed"
        if sub.recv_multipart()[0] == COMMAND_TOPIC:
            return


def recv_topic(sub: zmq.Socket, topic: bytes, timeout_s: float = 10.0) -> list[bytes]:
    """The frames (topic dropped) of the next message on `topic`, skipping other topics."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(left * 1000), f"nothing published on {topic!r} within {timeout_s:.0f}s"
        frames = sub.recv_multipart()
        if frames[0] == topic:
            return frames[1:]
