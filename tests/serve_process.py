"""Run `rollbus serve` as a child process and wait until it is ready: for tests, benchmarks and
trainers that launch the engine from Python."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, avoid: range = range(0)) -> int:
    """A base port whose n consecutive ports are all free now and outside `avoid` (a tcp bus binds base + i
    for each socket: one free port says nothing of the others)."""
    while True:
        base = free_port()
        if base + n > 65535 or any(p in avoid for p in range(base, base + n)):
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """Role -> pid of the launcher's children (from /proc: the children carry --port N)."""
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [c.decode(errors="replace") for c in cmd]
            if "engine.cli" in args and str(self.port) in args and "serve" not in args:
                out[_member_name(args, args[args.index("engine.cli") + 1])] = int(pid)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _member_name(args: list[str], role: str) -> str:
    """A child's bus name from its argv (engine.topology's names: worker-<dp rank x tp + tp rank>,
    scheduler-<dp rank> with more than one engine)."""
    def flag(name: str, default: int) -> int:
        return int(args[args.index(name) + 1]) if name in args else default

    engine, dp, tp = flag("--data-parallel-rank", 0), flag("--data-parallel-size", 1), flag("--tensor-parallel-size", 1)
    if role == "worker":
        return f"worker-{engine * tp + flag('--rank', 0)}"
    if role == "scheduler" and dp > 1:
        return f"scheduler-{engine}"
    return role


def start_server(workdir: Path, *args: str, timeout_s: float = 180.0) -> Server:
    """`rollbus serve *args` on a free port, its log and bus sockets under workdir."""
    port = free_port()
    log_path = workdir / f"serve-{port}.log"
    bus_dir = workdir / f"bus-{port}"
    ipc = ["--bus-dir", str(bus_dir)] if "tcp" not in args else []  # --bus-dir is for ipc sockets only
    cmd = [sys.executable, "-m", "engine.cli", "serve", *args, "--port", str(port), *ipc,
           "--heartbeat-timeout-s", "3"]
    f = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollbus serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
        if "rollbus: ready" in server.log():
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"rollbus serve not ready after {timeout_s}s:\n{server.log()[-4000:]}")
