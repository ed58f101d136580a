"""`rollbus serve`: start every process, wait for each READY, supervise, and stop them all together.

Children are the same `rollbus <role>` commands the Procfile runs, with the same flags. They live in
their own session (so Ctrl-C reaches only the launcher, which then stops them in order) and get
PR_SET_PDEATHSIG, so even a SIGKILLed launcher leaves no orphans on Linux.

Supervision: a worker, the scheduler or the gateway that dies after start-up is started again, alone (the
others keep running and take it back through the bus: docs/architecture.md "Liveness and recovery"),
within engine.restart_policy's limit (--max-restarts per minute, growing delays); past it, or when the
coordinator dies (the control state lives in it: pauses, weight versions, membership), everything stops
and the launcher exits 1. At exit the ipc socket files are removed.
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

from ascend_ops.host_env import cpu_only_host, huge_pages_env
from bus.codec import CodecError, decode
from bus.endpoints import Endpoints
from bus.messages import Ready
from bus.topology import Topology
from engine.config import EngineConfig
from engine.lora import model_problem as lora_model_problem
from engine.restart_policy import WINDOW_S, RestartPolicy
from engine.topology import check_devices

STOP_GRACE_S = 5.0


def _child_exited(signum, frame) -> None:
    """SIGCHLD: nothing to do here; the signal's byte in the wakeup pipe wakes the launcher's loop, which then
    finds the exited child (Popen.poll) at once instead of at its next 200 ms poll."""


class ReadyWait:
    """The launcher's wait for a message on its ready socket, woken at once by a signal: the signal module writes
    a byte to a pipe on each signal this process handles (signal.set_wakeup_fd), and the wait polls that pipe with
    the socket. So a Ctrl-C, a SIGTERM or a child's exit (SIGCHLD, handled here for that alone) is acted on at
    once, not at the next 200 ms poll (a test lane stops ~90 servers and waited ~0.1 s on average at each). Main
    thread only; `close` gives back the previous wakeup fd and SIGCHLD handler."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w)
        self._old_chld = signal.signal(signal.SIGCHLD, _child_exited)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._r, zmq.POLLIN)

    def wait(self, timeout_ms: int = 200) -> bool:
        """Up to timeout_ms for a message on the socket (true: one is there); false early when a signal came."""
        events = dict(self._poller.poll(timeout_ms))
        if self._r in events:
            try:
                while os.read(self._r, 64):
                    pass
            except BlockingIOError:
                pass
        return self.sock in events

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._old_chld)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: rely on the launcher's own shutdown


def roles(cfg: EngineConfig) -> list[tuple[str, list[str]]]:
    """(member name, extra argv) of every process on this host, in start order: the coordinator (head
    host only), each local engine's scheduler and workers (bus.topology), the gateway (head host only)."""
    topo = Topology.from_config(cfg)
    out = [("coordinator", ["coordinator"])] if topo.is_head else []
    for e in topo.local_engines:
        engine = ["--data-parallel-rank", str(e)]
        out.append((topo.scheduler_name(e), ["scheduler", *engine]))
        out += [(topo.worker_name(e, t), ["worker", "--rank", str(t), *engine]) for t in range(topo.tp)]
    if topo.is_head:
        out.append(("gateway", ["gateway"]))
    return out


def worker_env(topo: Topology, env: dict[str, str], platform_name: str) -> dict[str, str]:
    """The environment of the workers this host starts: on CPU their share of the cores and malloc on huge
    pages (ascend_ops.host_env.huge_pages_env; ValueError for a bad ROLLBUS_CPU_HUGE_PAGES)."""
    if platform_name != "cpu":
        return env
    return {**env, **cpu_thread_share(topo, env, platform_name), **huge_pages_env(env)}


def cpu_thread_share(topo: Topology, env: dict[str, str], platform_name: str) -> dict[str, str]:
    """On CPU with several workers on this host, each worker's share of the cores (OMP_NUM_THREADS =
    cores // workers), unless the user set OMP_NUM_THREADS: workers that each take every core contend."""
    workers = topo.dp_local * topo.tp
    if platform_name != "cpu" or workers < 2 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}



def launcher_platform() -> tuple[str, int]:
    """(platform name, device count) as the workers will see them: "cpu" and 1 without importing torch when
    ascend_ops.host_env.cpu_only_host(), otherwise ascend_ops.platform.current_platform()'s."""
    if cpu_only_host():
        return "cpu", 1
    from ascend_ops.platform import current_platform

    platform = current_platform()
    return platform.name, platform.device_count()


class Launcher:
    def __init__(self, cfg: EngineConfig, *, ready_timeout_s: float = 900.0):
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = False
        self.policy = RestartPolicy(cfg.bus.max_restarts)
        self.restarts: dict[str, float] = {}  # child -> when to start it again
        self.restarted_at: dict[str, float] = {}  # child -> when it was started again (for the "back" line)
        self._platform_name = "cpu"
        self.ray = None  # engine.fleet.ray_executor.RayWorkers with --distributed-executor-backend ray

    def run(self) -> int:
        from engine.model_store import resolve_model

        # Prepare the model once here (first run downloads and converts it, with progress), so the
        # children find it cached instead of racing to build it.
        folder = resolve_model(self.cfg.model.model, progress=True)
        why = self._layout_problem(folder)
        if why:
            print(f"rollbus: {why}", file=sys.stderr, flush=True)
            return 2
        if self.cfg.parallel.distributed_executor_backend == "ray":
            why = self._prepare_ray()
            if why:
                print(f"rollbus: {why}", file=sys.stderr, flush=True)
                return 2
        env = dict(os.environ)
        if self.cfg.gateway.api_key:
            env["VLLM_API_KEY"] = self.cfg.gateway.api_key
        try:
            self._worker_env = worker_env(Topology.from_config(self.cfg), env, self._platform_name)
        except ValueError as e:
            print(f"rollbus: {e}", file=sys.stderr, flush=True)
            if self.ray is not None:
                self.ray.stop()
            return 2
        ctx = zmq.Context()
        ready_dir = tempfile.mkdtemp(prefix="rollbus-launch-")
        endpoint = f"ipc://{ready_dir}/ready"
        ready_sock = ctx.socket(zmq.PULL)
        ready_sock.bind(endpoint)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self._ready = ReadyWait(ready_sock)
        self._argv, self._env = self.cfg.to_argv() + ["--ready-endpoint", endpoint], env
        self._role_argv = dict(roles(self.cfg))
        try:
            for name in self._role_argv:
                self._start(name)
            code = self._wait_ready(ready_sock)
            if code is None:
                code = self._supervise(ready_sock)
            return code
        finally:
            self._ready.close()
            self._stop_all()
            ctx.destroy(linger=0)
            try:
                os.unlink(os.path.join(ready_dir, "ready"))
                os.rmdir(ready_dir)
            except OSError:
                pass
            self._remove_bus_files()

    def _layout_problem(self, folder) -> str | None:
        """Why this layout cannot start (None: it can), before any process starts: a -tp the model cannot
        be split by, a single engine's --data-parallel-rank, more workers than devices."""
        if self.cfg.parallel.data_parallel_rank:
            return (f"--data-parallel-rank {self.cfg.parallel.data_parallel_rank} names the engine of one scheduler "
                    "or worker process; `rollbus serve` starts whole engines: use --data-parallel-start-rank and "
                    "--data-parallel-size-local")
        if self.cfg.lora.enable_lora and (why := lora_model_problem(folder)):
            return why
        if self.cfg.parallel.tensor_parallel_size > 1:
            from workers.models.checkpoint import load_hf_config  # imports torch: only where a split is checked
            from workers.models.tp_layout import layout_error

            why = layout_error(load_hf_config(folder), self.cfg.parallel.tensor_parallel_size)
            if why:
                return why
        if self.cfg.parallel.distributed_executor_backend == "ray":
            return None  # the workers' devices are their bundles' (engine.fleet.ray_placement)
        self._platform_name, device_count = launcher_platform()  # no torch import on a CPU-only host
        return check_devices(Topology.from_config(self.cfg), self._platform_name, device_count)

    def _prepare_ray(self) -> str | None:
        """Ray: connect, place the workers on a placement group's bundles, make the bus keys; why not."""
        try:
            from engine.fleet.ray_executor import missing_ray_message
        except ImportError as e:
            return f"--distributed-executor-backend ray: {e}"
        why = missing_ray_message()
        if why:
            return why
        from engine.fleet.ray_executor import RayWorkers
        from engine.fleet.ray_placement import PlacementError

        try:
            self.ray = RayWorkers.prepare(self.cfg, Topology.from_config(self.cfg))
        except PlacementError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - Ray could not be reached or started: say so, with its words
            return f"--distributed-executor-backend ray: Ray failed: {type(e).__name__}: {e}"
        self.cfg = self.ray.cfg  # the tcp bus host and key folder every process is started with
        print(f"rollbus: {self.ray.describe()}", file=sys.stderr, flush=True)
        return None

    def _start(self, name: str) -> None:
        if self.ray is not None and self._role_argv[name][0] == "worker":
            self.ray.start(name, self._role_argv[name], self._argv[:-2])  # the actor has its own ready endpoint
        else:
            self._spawn(name)

    def _spawn(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", *self._role_argv[name], *self._argv],
            env=self._worker_env if self._role_argv[name][0] == "worker" else self._env, start_new_session=True,
            preexec_fn=_die_with_parent)

    def _remove_bus_files(self) -> None:
        """The ipc socket files the children bound (a SIGKILLed child cannot remove its own)."""
        if self.cfg.bus.bus_transport != "ipc":
            return
        try:
            ep = Endpoints.from_config(self.cfg)
        except Exception:  # noqa: BLE001 - nothing to clean if the folder cannot even be named
            return
        paths = [a[len("ipc://"):] for a in ep.all_addresses()]
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not self.cfg.bus.bus_dir:  # our default per-port folder: remove it too when empty
            try:
                os.rmdir(os.path.dirname(paths[0]))
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
        waiting = set(self._role_argv)
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
            if self.ray is not None:
                ready, dead = self.ray.poll()
                waiting -= {name for name, _ in ready}
                if dead:
                    print(f"rollbus: {dead[0][0]}'s Ray actor died during start-up ({dead[0][1]}); stopping",
                          file=sys.stderr, flush=True)
                    return 1
            if self._ready.wait():
                msg = self._recv_ready(sock)
                if isinstance(msg, Ready):
                    waiting.discard("gateway" if msg.role == "gateway" else msg.name)
        topo = Topology.from_config(self.cfg)
        if not topo.is_head:
            print(f"rollbus: ready in {time.monotonic() - t0:.1f}s: engines {topo.dp_start}.."
                  f"{topo.dp_start + topo.dp_local - 1} of --data-parallel-size {topo.dp} (the gateway and the "
                  "coordinator run on the host with --data-parallel-start-rank 0; Ctrl-C stops)", flush=True)
            return None
        url = f"http://{self.cfg.gateway.host}:{self.cfg.gateway.port}"
        print(f"rollbus: ready in {time.monotonic() - t0:.1f}s, serving {self.cfg.model.model_name} at {url}  "
              f"(OpenAI API at {url}/v1; Ctrl-C stops)", flush=True)
        return None

    def _supervise(self, sock: zmq.Socket) -> int:
        while not self._stop:
            now = time.monotonic()
            for name, p in self.procs.items():
                if p.poll() is None or name in self.restarts:
                    continue
                what = f"{name} (pid {p.pid}) exited with code {p.returncode}"
                if name == "coordinator":
                    print(f"rollbus: {what}; the control state (pauses, weight versions, membership) lived in "
                          "it and cannot be rebuilt: stopping all processes", file=sys.stderr, flush=True)
                    return 1
                delay = self.policy.on_exit(name, now)
                if delay is None:
                    print(f"rollbus: {what}; it died {self.policy.recent(name) + 1} times within {WINDOW_S:.0f}s "
                          f"(--max-restarts {self.cfg.bus.max_restarts}): giving up, stopping all processes",
                          file=sys.stderr, flush=True)
                    return 1
                print(f"rollbus: {what}; restarting it in {delay:.1f}s (restart {self.policy.recent(name)} of "
                      f"{self.cfg.bus.max_restarts} within {WINDOW_S:.0f}s); the other processes keep running",
                      file=sys.stderr, flush=True)
                self.restarts[name] = now + delay
            for name, at in list(self.restarts.items()):
                if now >= at:
                    del self.restarts[name]
                    self._spawn(name)
                    self.restarted_at[name] = time.monotonic()
            if self.ray is not None and self._ray_deaths(now):
                return 1
            if self._ready.wait():
                self._on_ready(sock)
        return 0

    @staticmethod
    def _recv_ready(sock: zmq.Socket):
        """The next message on the ready socket; one it cannot decode (a child of another rollbus version, a
        stray sender) is logged, not silently dropped: a start-up that then times out says why."""
        frames = sock.recv_multipart()
        try:
            return decode(frames)
        except CodecError as e:
            print(f"rollbus: an undecodable message on the ready socket ({e}); ignored", file=sys.stderr, flush=True)
            return None

    def _ray_deaths(self, now: float) -> bool:
        """Ray worker actors: a death counts against --max-restarts (Ray restarts the actor on its bundle); true
        when it is one too many, or the actor cannot come back."""
        ready, dead = self.ray.poll()
        for name, info in ready:
            self._back(name, info["pid"])
        for name, why in dead:
            delay = None if name in self.ray.gone else self.policy.on_exit(name, now)
            if delay is None:
                print(f"rollbus: {name}'s Ray actor died ({why}); "
                      + (f"it died {self.policy.recent(name) + 1} times within {WINDOW_S:.0f}s (--max-restarts "
                         f"{self.cfg.bus.max_restarts})" if name not in self.ray.gone else "Ray will not restart it")
                      + ": giving up, stopping all processes", file=sys.stderr, flush=True)
                return True
            print(f"rollbus: {name}'s Ray actor died ({why}); Ray restarts it on its bundle (restart "
                  f"{self.policy.recent(name)} of {self.cfg.bus.max_restarts} within {WINDOW_S:.0f}s); the other "
                  "processes keep running", file=sys.stderr, flush=True)
            self.restarted_at[name] = time.monotonic()
        return False

    def _on_ready(self, sock: zmq.Socket) -> None:
        """A restarted child finished its start-up."""
        msg = self._recv_ready(sock)
        if not isinstance(msg, Ready):
            return
        self._back("gateway" if msg.role == "gateway" else msg.name, msg.pid)

    def _back(self, name: str, pid: int) -> None:
        started = self.restarted_at.pop(name, None)
        if started is not None:
            print(f"rollbus: {name} is back (pid {pid}, ready {time.monotonic() - started:.1f}s after its "
                  "restart)", file=sys.stderr, flush=True)

    def _stop_all(self) -> None:
        """The gateway first: SIGTERM makes it drain (new requests 503, running ones get --shutdown-timeout
        seconds, then are aborted) and exit; then SIGTERM the rest, SIGKILL stragglers."""
        gateway = self.procs.get("gateway")
        if gateway is not None and gateway.poll() is None and self._stop:
            print(f"rollbus: stopping; running requests get {self.cfg.gateway.shutdown_timeout}s (--shutdown-timeout)",
                  file=sys.stderr, flush=True)
            gateway.terminate()
            try:
                gateway.wait(self.cfg.gateway.shutdown_timeout + 2 * STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                gateway.kill()
        if self.ray is not None:  # the workers, then the scheduler and the coordinator
            self.ray.stop()
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
