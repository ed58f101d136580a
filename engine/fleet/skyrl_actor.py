"""RollbusServerActor: one `rollbus serve` engine as the Ray actor SkyRL 0.4's ServerGroup places
(`ServerGroup(cli_args, num_servers, server_actor_cls=RollbusServerActor)`; the interface is SkyRL's
`inference_servers/protocols.py` ServerActorProtocol). docs/fleet.md has the recipe.

What it does, from the placement SkyRL gives it:
- cli_args is vLLM's serve Namespace: engine.fleet.serve_args turns it into `rollbus serve` flags, checked
  as on the command line (a refused flag fails start() with the command line's message). The engine always
  gets --enable-scale-out (SkyRL generates through /inference/v1/generate and /skyrl/v1/generate) and the
  development routes SkyRL drives (pause, resume, sleep, wake, weight sync: VLLM_SERVER_DEV_MODE=1, as
  SkyRL's own actor sets); sleep mode is turned on when the engine is colocated with training.
- Devices: the bundles' GPU ids (ServerGroup passes them, `_gpu_ids`) become CUDA_VISIBLE_DEVICES and
  ASCEND_RT_VISIBLE_DEVICES of the engine (Ray leaves them unset for these num_gpus=0 actors). On a host
  with no accelerator the cluster's GPUs are logical: each maps to one CPU worker with `cpus_per_gpu`
  threads (OMP_NUM_THREADS), and no device variable is set.
- A KV event endpoint in cli_args.kv_events_config (tcp://*:P) is offset by the server index, as vLLM offsets
  it by data-parallel rank, so engines on one host do not collide; kv_events_endpoint() says where.
- Supervision: the engine runs as a child process with PR_SET_PDEATHSIG (a killed actor takes it down;
  its own children follow the launcher the same way), is restarted when it dies (after 1 s, doubling to
  16 s), and start() returns only once /health is 200. The actor itself is restartable: its class asks Ray
  for `RAY_ACTOR_OPTIONS` (max_restarts; SkyRL's ServerGroup creates actors without it, and
  engine.fleet.skyrl_compat applies these options), and an actor that Ray reconstructs after its process
  died starts its engine again by itself (SkyRL calls start() once), on the same port, from its copies.
  Its workers keep a copy of every committed weight update (--weights-recovery-dir:
  cli_args.weights_recovery_dir/server-<index>, else <log_dir>/weights) and a restarted engine starts on that
  version (--weights-recovery-resume, engine.fleet.rejoin), never silently on the checkpoint; where a copy is
  missing, it answers 503 naming the version until the next update.

Only this module and engine.fleet.ray_executor import Ray (`pip install rollbus[ray]`). The engine is started
with ROLLBUS_PYTHON (default: this process's python) `-m engine.cli serve`; ROLLBUS_PYTHONPATH, when set, is
its PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from engine.fleet.child_process import die_with_parent, has_accelerator

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = float(os.environ.get("ROLLBUS_FLEET_HEALTH_TIMEOUT_S", "600"))
RESTART_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)
PORT_WAIT_S = 60.0  # a reconstructed actor waits this long for its engine's old port to be free again


@dataclass
class ServerInfo:
    """SkyRL's ServerInfo (inference_servers/common.py), field for field: what start() returns and SkyRL's
    pool reads (.url). Our own class, so that the actor never imports SkyRL (which needs Python 3.12)."""

    ip: str
    port: int
    mooncake_bootstrap_server_port: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"


def node_ip() -> str:
    """This node's address as others reach it: ROLLBUS_FLEET_HOST when set (e.g. 127.0.0.1 for a one-host
    cluster), else Ray's node address."""
    if os.environ.get("ROLLBUS_FLEET_HOST"):
        return os.environ["ROLLBUS_FLEET_HOST"]
    try:
        import ray

        return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # outside a Ray worker
        return "127.0.0.1"


def _port_free(port: int) -> bool:
    """The engine's server could listen on port (probed as it binds: SO_REUSEADDR, so that connections of
    an engine that just died, in TIME_WAIT, do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _free_port(start: int) -> int:
    for port in range(start, min(start + 1000, 65536)):
        if _port_free(port):
            return port
    raise RuntimeError(f"no free port in [{start}, {start + 1000})")


def _ray_actor() -> tuple[str | None, bool]:
    """(this Ray actor's id, whether Ray reconstructed it after its process died); (None, False) outside."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        return actor_id, bool(actor_id) and ctx.was_current_actor_reconstructed
    except Exception:  # no Ray, or not in an actor
        return None, False


def serve_argv(cli_args: Namespace | dict[str, Any], python: str) -> list[str]:
    """rollbus serve flags for cli_args, computed by the rollbus python (this process may lack rollbus's
    dependencies); RuntimeError with the command line's message when rollbus refuses something."""
    values = dict(vars(cli_args)) if isinstance(cli_args, Namespace) else dict(cli_args)
    env = dict(os.environ)
    if os.environ.get("ROLLBUS_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["ROLLBUS_PYTHONPATH"]
    r = subprocess.run([python, "-m", "engine.fleet.serve_args", json.dumps(values, default=str)],
                       capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip() or f"engine.fleet.serve_args exited with {r.returncode}")
    return json.loads(r.stdout)


class RollbusServerActor:
    """SkyRL's ServerActorProtocol, for `rollbus serve`."""

    # What Ray should create this actor with (engine.fleet.skyrl_compat gives them to SkyRL's ServerGroup):
    # restart it whenever its process dies (a node's OOM killer, a SIGKILL); ray.kill() and shutdown stay
    # final. Calls in flight when it died fail (max_task_retries 0): a generation is not idempotent.
    RAY_ACTOR_OPTIONS = {"max_restarts": -1, "max_task_retries": 0}

    @staticmethod
    def compute_num_gpus_per_server(cli_args: Namespace) -> int:
        return int(getattr(cli_args, "tensor_parallel_size", 1) or 1) * \
            int(getattr(cli_args, "pipeline_parallel_size", 1) or 1)

    @staticmethod
    def prepare_server_kwargs(pg: Any, start_bundle_idx: int, num_gpus_per_server: int, **kwargs: Any
                              ) -> dict[str, Any]:
        kwargs["gpu_ids"] = kwargs.pop("_gpu_ids", None)
        return kwargs

    def __init__(self, cli_args: Namespace, start_port: int = 8000, server_idx: int = 0,
                 bundle_indices: list[int] | None = None, dp_size: int = -1, dp_master_address: str | None = None,
                 dp_rpc_port: int | None = None, enable_pd: bool = False, nixl_side_channel_base: int = 5600,
                 mooncake_bootstrap_base_port: int = 50052, colocated_training: bool = False,
                 gpu_ids: list[int] | None = None, distributed_executor_backend: str = "mp",
                 cpus_per_gpu: int = 1, log_dir: str | None = None, **kwargs: Any):
        if kwargs:
            raise ValueError(f"RollbusServerActor: unknown keyword arguments {sorted(kwargs)}")
        if enable_pd:
            raise ValueError("RollbusServerActor: prefill-decode disaggregation (enable_pd) is not supported")
        if dp_size > 0:
            raise ValueError("RollbusServerActor: vLLM's data-parallel group across servers (enable_dp) is not "
                             "supported: each rollbus engine is an independent replica; put a router in front "
                             "(docs/fleet.md)")
        if distributed_executor_backend != "mp":
            raise ValueError(f"RollbusServerActor: distributed_executor_backend {distributed_executor_backend!r} "
                             "is not supported: this actor starts its engine's workers as its own processes on "
                             "its node (mp), one engine per SkyRL server; to spread one engine's tensor-parallel "
                             "workers over Ray bundles (across hosts), run `rollbus serve "
                             "--distributed-executor-backend ray` yourself and give SkyRL its URL "
                             "(external_server_urls; docs/fleet.md)")
        self.cli_args = Namespace(**vars(cli_args)) if isinstance(cli_args, Namespace) else Namespace(**cli_args)
        self.server_idx = server_idx
        self.bundle_indices = bundle_indices
        self.colocated = colocated_training
        self.gpu_ids = [int(g) for g in gpu_ids] if gpu_ids else None
        self.cpus_per_gpu = max(1, int(cpus_per_gpu))
        self.ip = node_ip()
        self.python = os.environ.get("ROLLBUS_PYTHON", sys.executable)
        actor_id, reconstructed = _ray_actor()
        if log_dir:
            self.log_dir = Path(log_dir)
        elif actor_id:  # a Ray actor's folder outlives its process (the same id after a restart): port, copies
            self.log_dir = Path(tempfile.gettempdir()) / f"rollbus-fleet-{server_idx}-{actor_id[:16]}"
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"rollbus-fleet-{server_idx}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kv_endpoint = self._offset_kv_events()
        self._keep_weights()
        self.proc: subprocess.Popen | None = None
        self.argv: list[str] | None = None
        self.restarts = 0
        self.stopping = False
        self.monitor: asyncio.Task | None = None
        port_file = self.log_dir / f"port-{server_idx}"
        if reconstructed and port_file.is_file():  # the URL the router and the trainer know
            self.port = int(port_file.read_text())
        else:  # (a reconstructed actor without its folder gets a new URL: logged by _revive)
            self.port = _free_port(start_port)
            port_file.write_text(str(self.port))
        self.reviver: threading.Thread | None = None
        if reconstructed:
            self.reviver = threading.Thread(target=asyncio.run, args=(self._revive(),),
                                            name=f"rollbus-engine-{server_idx}", daemon=True)
            self.reviver.start()

    # --- SkyRL's protocol --------------------------------------------------------------------------

    def get_server_info(self) -> ServerInfo:
        return ServerInfo(ip=self.ip, port=self.port)

    def get_dp_info(self) -> tuple[str, int]:
        return self.ip, self.port  # never asked: data parallelism across servers is refused above

    async def start(self) -> ServerInfo:
        """Start the engine; returns once its /health answers 200 (RuntimeError naming why it did not)."""
        self.argv = await asyncio.to_thread(self._argv)
        self._launch()
        await self._wait_healthy()
        self.monitor = asyncio.get_running_loop().create_task(self._supervise())
        return self.get_server_info()

    async def _revive(self) -> None:
        """Ray reconstructed this actor (its process died, and its engine with it): the engine comes back as
        start() would have started it, on the same port (the URL the router and the trainer know), then is
        supervised. Runs on a thread of its own, which must outlive the child (PR_SET_PDEATHSIG)."""
        logger.warning("rollbus engine %d: actor restarted by Ray; starting the engine again on port %d",
                       self.server_idx, self.port)
        deadline = time.monotonic() + PORT_WAIT_S
        while not _port_free(self.port) and time.monotonic() < deadline and not self.stopping:
            await asyncio.sleep(0.5)
        try:
            self.argv = await asyncio.to_thread(self._argv)
            self._launch()
            await self._wait_healthy()
        except RuntimeError as e:
            logger.error("rollbus engine %d: not back after the actor restart: %s", self.server_idx, e)
        await self._supervise()

    def actor_restarted(self) -> bool:
        """Ray reconstructed this actor (and it started its engine again by itself)."""
        return self.reviver is not None

    async def shutdown(self) -> None:
        self.stopping = True
        if self.monitor is not None:
            self.monitor.cancel()
        await asyncio.to_thread(self._stop_child)

    # --- extras (for tests and operators) ------------------------------------------------------------

    def kv_events_endpoint(self) -> str | None:
        """Where a router subscribes to this engine's KV events (tcp://IP:PORT), when cli_args asked for them."""
        return self.kv_endpoint

    def actor_pid(self) -> int:
        return os.getpid()

    def child_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def restart_count(self) -> int:
        return self.restarts

    def log_path(self) -> str:
        return str(self.log_dir / "serve.log")

    # --- the child -------------------------------------------------------------------------------

    def _offset_kv_events(self) -> str | None:
        raw = getattr(self.cli_args, "kv_events_config", None)
        if not raw:
            return None
        cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
        if not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
            return None
        endpoint = cfg.get("endpoint", "tcp://*:5557")
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint.rpartition(":")
            endpoint = f"{host}:{int(port) + self.server_idx}"
            cfg["endpoint"] = endpoint
        self.cli_args.kv_events_config = json.dumps(cfg)
        return endpoint.replace("*", self.ip) if endpoint.startswith("tcp://") else endpoint

    def _keep_weights(self) -> None:
        """A restarted engine rejoins on the version its workers last committed (engine.fleet.rejoin): every
        engine keeps its copies in a folder of its own (cli_args.weights_recovery_dir/server-<index>, so
        that a new actor for the same server finds them; else <log_dir>/weights) and resumes them."""
        base = getattr(self.cli_args, "weights_recovery_dir", None)
        folder = Path(base) / f"server-{self.server_idx}" if base else self.log_dir / "weights"
        self.cli_args.weights_recovery_dir = str(folder)
        self.cli_args.weights_recovery_resume = True

    def weights_recovery_dir(self) -> str:
        return str(self.cli_args.weights_recovery_dir)

    def _argv(self) -> list[str]:
        argv = serve_argv(self.cli_args, self.python)
        extra = ["--host", "0.0.0.0", "--port", str(self.port)]
        if "--enable-scale-out" not in argv and "--tokens-only" not in argv:
            extra.append("--enable-scale-out")
        if self.colocated and "--enable-sleep-mode" not in argv:
            extra.append("--enable-sleep-mode")
        return [self.python, "-m", "engine.cli", "serve", *argv, *extra]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the development routes SkyRL's control plane calls
        if os.environ.get("ROLLBUS_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["ROLLBUS_PYTHONPATH"]
        for var in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
            env.pop(var, None)
        if has_accelerator():
            if self.gpu_ids:
                ids = ",".join(map(str, self.gpu_ids))
                env["CUDA_VISIBLE_DEVICES"] = env["ASCEND_RT_VISIBLE_DEVICES"] = ids
        else:  # logical GPUs on a CPU-only cluster: one CPU worker per GPU, with that GPU's share of threads
            gpus = self.compute_num_gpus_per_server(self.cli_args)
            env["OMP_NUM_THREADS"] = str(self.cpus_per_gpu * gpus)
        return env

    def _launch(self) -> None:
        assert self.argv is not None
        log = open(self.log_path(), "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                     preexec_fn=die_with_parent)
        log.close()
        logger.info("rollbus engine %d: pid %d on port %d", self.server_idx, self.proc.pid, self.port)

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path()).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def _wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"rollbus serve (engine {self.server_idx}) exited with {code}:\n{self._log_tail()}")
            if await asyncio.to_thread(_health_ok, url):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"rollbus serve (engine {self.server_idx}) not healthy after {timeout_s:.0f}s:\n"
                           f"{self._log_tail()}")

    async def _supervise(self) -> None:
        """Restart a dead engine (the same command line), backing off while it keeps dying."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            if self.stopping or self.proc is None or self.proc.poll() is None:
                continue
            code = self.proc.returncode
            delay = RESTART_DELAYS_S[min(self.restarts, len(RESTART_DELAYS_S) - 1)]
            logger.warning("rollbus engine %d exited with %s; restarting in %.0f s", self.server_idx, code, delay)
            await asyncio.sleep(delay)
            if self.stopping:
                return
            self.restarts += 1
            self._launch()
            try:
                await self._wait_healthy()
            except RuntimeError as e:
                logger.error("rollbus engine %d failed to come back: %s", self.server_idx, e)

    def _stop_child(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _health_ok(url: str) -> bool:
    try:
        with urlopen(url, timeout=5) as r:
            return r.status == 200
    except (URLError, OSError):
        return False
