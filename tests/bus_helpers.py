"""Real coordinator processes and real member loops for bus tests."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import zmq

from bus.control_client import ControlClient  # noqa: F401  (re-exported for the bus tests)
from bus.endpoints import Endpoints
from bus.member import MemberLink
from bus.messages import command_name
from engine.config import EngineConfig


def bus_config(tmp_path, **kw) -> EngineConfig:
    kw.setdefault("heartbeat_interval_s", 0.2)
    kw.setdefault("heartbeat_timeout_s", 1.5)
    kw.setdefault("control_timeout_s", 3.0)
    return EngineConfig.from_flags(bus_dir=str(tmp_path), **kw)


def start_coordinator(cfg: EngineConfig) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "coordinator", *cfg.to_argv()])
    return p


class MemberThread:
    """A member's poll loop in a thread (its sockets are created and used only there)."""

    def __init__(self, ep: Endpoints, name: str, role: str = "worker", *, interval=0.2, timeout=3.0,
                 apply=None, protocol_version=None):
        self.ep, self.name, self.role = ep, name, role
        self.interval, self.timeout = interval, timeout
        self.applied: list = []
        self.user_apply = apply
        self.error: Exception | None = None
        self.stop = threading.Event()
        self.welcomed = threading.Event()
        self.link: MemberLink | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _apply(self, body):
        """Every command (no typed handlers): record (seq, command name), ack with nothing (or apply's)."""
        self.applied.append((self.link.follower.current.seq, command_name(body)))
        return self.user_apply(body) if self.user_apply else None

    def _run(self):
        ctx = zmq.Context()
        try:
            self.link = MemberLink(ctx, self.ep, role=self.role, name=self.name, default=self._apply,
                                   heartbeat_interval_s=self.interval, heartbeat_timeout_s=self.timeout)
            poller = zmq.Poller()
            for s in self.link.sockets:
                poller.register(s, zmq.POLLIN)
            while not self.stop.is_set():
                for s, _ in poller.poll(50):
                    self.link.handle(s)
                if self.link.welcomed:
                    self.welcomed.set()
                self.link.tick(time.monotonic())
        except Exception as e:
            self.error = e
        finally:
            if self.link is not None:
                self.link.close()
            ctx.destroy(linger=0)

    def close(self):
        self.stop.set()
        self.thread.join(5)


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
