"""Start the real engine (`rollbus serve`: every process, real sockets) for integration tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                role = args[args.index("engine.cli") + 1]
                if role == "worker":
                    role += "-" + args[args.index("--rank") + 1]
                out[role] = int(pid)
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


def start_server(tmp_path: Path, *args: str, timeout_s: float = 180.0) -> Server:
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    bus_dir = tmp_path / f"bus-{port}"
    cmd = [sys.executable, "-m", "engine.cli", "serve", *args, "--port", str(port), "--bus-dir", str(bus_dir),
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


def tiny_model_with_tokenizer(arch: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A tiny random checkpoint with a real tokenizer beside it, servable by the gateway."""
    from tests.tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint(arch, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
