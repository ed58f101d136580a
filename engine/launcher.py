"""`rollbus serve`: start every process, wait for each READY, supervise, and stop them all together.

Children are the same `rollbus <role>` commands the Procfile runs, with the same flags. They live in
their own session (so Ctrl-C reaches only the launcher, which then stops them in order) and get
PR_SET_PDEATHSIG, so even a SIGKILLed launcher leaves no orphans on Linux.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from bus.codec import CodecError, decode
from bus.messages import Ready
from engine.config import EngineConfig

STOP_GRACE_S = 5.0


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: rely on the launcher's own shutdown


def roles(cfg: EngineConfig) -> list[tuple[str, list[str]]]:
    """(member name, extra argv) of every process, in start order."""
    out = [("coordinator", ["coordinator"]), ("scheduler", ["scheduler"])]
    out += [(f"worker-{r}", ["worker", "--rank", str(r)]) for r in range(cfg.num_workers)]
    out.append(("gateway", ["gateway"]))
    return out


class Launcher:
    def __init__(self, cfg: EngineConfig, *, ready_timeout_s: float = 900.0):
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = False

    def run(self) -> int:
        from engine.model_store import resolve_model

        # Prepare the model once here (first run downloads and converts it, with progress), so the
        # children find it cached instead of racing to build it.
        resolve_model(self.cfg.model, progress=True)
        ctx = zmq.Context()
        ready_dir = tempfile.mkdtemp(prefix="rollbus-launch-")
        endpoint = f"ipc://{ready_dir}/ready"
        ready_sock = ctx.socket(zmq.PULL)
        ready_sock.bind(endpoint)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        argv = self.cfg.to_argv() + ["--ready-endpoint", endpoint]
        env = dict(os.environ)
        if self.cfg.api_key:
            env["VLLM_API_KEY"] = self.cfg.api_key
        try:
            for name, role_argv in roles(self.cfg):
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "engine.cli", *role_argv, *argv],
                    env=env, start_new_session=True, preexec_fn=_die_with_parent)
            code = self._wait_ready(ready_sock)
            if code is None:
                code = self._supervise()
            return code
        finally:
            self._stop_all()
            ctx.destroy(linger=0)
            try:
                os.unlink(os.path.join(ready_dir, "ready"))
                os.rmdir(ready_dir)
            except OSError:
                pass

    def _on_signal(self, signum, frame) -> None:
        """First SIGTERM/SIGINT: stop gracefully (the gateway drains, see _stop_all). Second: at once."""
        if self._stop:
            print("rollbus: second signal; stopping at once", file=sys.stderr, flush=True)
            self._kill_all()
        self._stop = True

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass

    def _dead_child(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def _wait_ready(self, sock: zmq.Socket) -> int | None:
        t0 = time.monotonic()
        waiting = set(self.procs)
        while waiting:
            if self._stop:
                return 0
            dead = self._dead_child()
            if dead:
                print(f"rollbus: {dead} during start-up; stopping", file=sys.stderr, flush=True)
                return 1
            if time.monotonic() - t0 > self.ready_timeout_s:
                print(f"rollbus: not ready after {self.ready_timeout_s:.0f}s: {sorted(waiting)}", file=sys.stderr)
                return 1
            if sock.poll(200):
                try:
                    msg = decode(sock.recv_multipart())
                except CodecError:
                    continue
                if isinstance(msg, Ready):
                    waiting.discard("gateway" if msg.role == "gateway" else msg.name)
        url = f"http://{self.cfg.host}:{self.cfg.port}"
        print(f"rollbus: ready in {time.monotonic() - t0:.1f}s, serving {self.cfg.model_name} at {url}  "
              f"(OpenAI API at {url}/v1; Ctrl-C stops)", flush=True)
        return None

    def _supervise(self) -> int:
        while not self._stop:
            dead = self._dead_child()
            if dead:
                print(f"rollbus: {dead}; stopping all processes", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0

    def _stop_all(self) -> None:
        """The gateway first: SIGTERM makes it drain (new requests 503, running ones get --shutdown-timeout
        seconds, then are aborted) and exit; then SIGTERM the rest, SIGKILL stragglers."""
        gateway = self.procs.get("gateway")
        if gateway is not None and gateway.poll() is None and self._stop:
            print(f"rollbus: stopping; running requests get {self.cfg.shutdown_timeout}s (--shutdown-timeout)",
                  file=sys.stderr, flush=True)
            gateway.terminate()
            try:
                gateway.wait(self.cfg.shutdown_timeout + 2 * STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                gateway.kill()
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
