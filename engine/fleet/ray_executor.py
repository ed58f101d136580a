"""`rollbus serve --distributed-executor-backend ray`: the engine's workers as Ray actors on the bundles of a
placement group (docs/fleet.md "One engine's workers on Ray"). Imports Ray: `pip install rollbus[ray]`.

The launcher (engine.launcher) still starts the coordinator, the schedulers and the gateway as its children;
`RayWorkers` replaces only how it starts the workers. Each worker is a `WorkerHost` actor, thin: it starts the
same `rollbus worker` process as the mp backend does (as its child, with PR_SET_PDEATHSIG) and watches it, so
the bus, the tp group and the recovery code are unchanged. When the worker process exits, the actor process
ends with it, and Ray restarts the actor on the same bundle (max_restarts), which starts a new worker process
that rejoins through the bus as a restarted worker always does; the launcher counts the deaths against
--max-restarts and gives up past it. A killed actor takes its worker process down (PR_SET_PDEATHSIG), and
the actors belong to the launcher's Ray driver, so they end with it.

Every message still travels on the ZeroMQ bus, over tcp with CURVE: the launcher makes the engine's key pair
(or reads --bus-curve-dir) and hands the key files to each actor, which writes them into a private folder
(0700, files 0600) on its node for its worker. The keys travel in the actor's creation arguments, i.e. over
Ray's own channel: turn on Ray's TLS (RAY_USE_TLS) where that network is not trusted. The worker's Ready goes
to its actor over an ipc socket in that folder and on to the launcher as the result of `ready()`.

The placement group: the one this process runs in (`ray.util.get_current_placement_group()`, as vLLM), or the
one whose hex id ROLLBUS_RAY_PLACEMENT_GROUP names (for a `rollbus serve` started by a process placed in it),
else one created with a bundle per worker (engine.fleet.ray_placement) and removed at exit.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from engine.fleet.child_process import die_with_parent, has_accelerator
from engine.fleet.ray_placement import (
    Placement,
    PlacementError,
    bundles_for,
    device_env,
    device_key,
)
from engine.fleet.ray_placement import plan as plan_placement

try:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # the launcher reports it (missing_ray_message) before anything starts
    ray = None

PG_ENV = "ROLLBUS_RAY_PLACEMENT_GROUP"
PG_READY_TIMEOUT_S = float(os.environ.get("ROLLBUS_RAY_PG_TIMEOUT_S", "120"))
NAMESPACE = "rollbus"
FORWARDED_ENV = ("ROLLBUS_", "VLLM_", "OMP_", "HF_", "TORCH_", "NCCL_", "HCCL_", "GLOO_")  # to the workers
NOT_FORWARDED = frozenset({"VLLM_API_KEY"})  # the gateway's; workers never need it
STOP_GRACE_S = 5.0
RESTARTING = "actor is restarting"  # Ray's ActorUnavailableError for a call made while the actor restarts


def missing_ray_message() -> str | None:
    if ray is None:
        return ("--distributed-executor-backend ray needs Ray, which is not installed in this Python "
                f"({sys.executable}): pip install rollbus[ray]")
    return None


# ------------------------------------------------------------------------------------------- the worker actor


class WorkerHost:
    """One worker's Ray actor: starts `python -m engine.cli worker ...` and lives exactly as long as it does."""

    def __init__(self, name: str, tag: str, argv: list[str], env: dict[str, str], keys: dict[str, bytes],
                 bundle: dict[str, float], workers_on_node: int):
        import zmq

        self.name, self.stopping, self.stopped = name, False, threading.Event()
        # one folder per actor name (0700): a restarted actor removes what its killed incarnation left
        self.folder = os.path.join(tempfile.gettempdir(), f"rollbus-ray-{os.getuid()}-{tag}")
        shutil.rmtree(self.folder, ignore_errors=True)
        os.mkdir(self.folder, 0o700)
        extra = ["--ready-endpoint", f"ipc://{self.folder}/ready", "--device-index", "0"]
        if keys:
            kdir = os.path.join(self.folder, "keys")
            os.mkdir(kdir, 0o700)
            for fname, data in keys.items():
                fd = os.open(os.path.join(kdir, fname), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            extra += ["--bus-curve-dir", kdir]
        self.ctx = zmq.Context()
        self.ready_sock = self.ctx.socket(zmq.PULL)
        self.ready_sock.bind(f"ipc://{self.folder}/ready")
        ctx = ray.get_runtime_context()
        self.accelerators = {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v}
        child_env = {**os.environ, **env}
        if not has_accelerator():
            from ascend_ops.host_env import huge_pages_env

            child_env.update(huge_pages_env(child_env))
        for var, value in device_env(self.accelerators, accelerator=has_accelerator(), bundle=bundle,
                                     cpu_count=os.cpu_count() or 1, workers_on_node=workers_on_node,
                                     environ=env).items():
            if value is None:
                child_env.pop(var, None)
            else:
                child_env[var] = value
        self.visible = {k: child_env[k] for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
                                                    "OMP_NUM_THREADS") if k in child_env}
        self.proc: subprocess.Popen | None = None
        started = threading.Event()
        # the child is started by the thread that waits for it: PR_SET_PDEATHSIG fires when the thread that
        # forked it ends, so that thread must live as long as the actor
        threading.Thread(target=self._run, args=([sys.executable, "-m", "engine.cli", *argv, *extra], child_env,
                                                 started), daemon=True, name="rollbus-worker-watch").start()
        started.wait()

    def _run(self, cmd: list[str], env: dict[str, str], started: threading.Event) -> None:
        try:
            self.proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        except OSError as e:
            what = f"could not start: {e}"
        started.set()
        if self.proc is not None:
            what = f"(pid {self.proc.pid}) exited with code {self.proc.wait()}"
        if self.stopping:
            return
        print(f"rollbus: {self.name} {what}; ending its Ray actor so that Ray restarts it", file=sys.stderr,
              flush=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(1)  # a failure, so Ray restarts the actor (an intentional exit would not be)

    def ready(self) -> dict[str, Any]:
        """Blocks until the worker process reports Ready; what the launcher prints and tests read."""
        from bus.codec import CodecError, decode
        from bus.messages import Ready

        while True:
            if self.ready_sock.poll(200):
                try:
                    msg = decode(self.ready_sock.recv_multipart())
                except CodecError:
                    continue
                if isinstance(msg, Ready):
                    return self.describe()

    def describe(self) -> dict[str, Any]:
        """This worker: its process, its actor's, its node, its bundle's accelerator ids and what its process sees."""
        return {"name": self.name, "pid": self.proc.pid, "actor_pid": os.getpid(), "node_ip": _node_ip(),
                "accelerators": self.accelerators, "env": self.visible}

    def wait_exit(self) -> int:
        """Returns the worker's exit code after stop(); an unexpected exit ends the actor first (_run), so the
        call fails instead, which is how the launcher hears of it."""
        code = self.proc.wait()
        self.stopped.wait()
        return code

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        self.stopping = True
        self.stopped.set()
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)
        return None if p is None else p.returncode


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


# ------------------------------------------------------------------------------------------- the launcher side


@dataclasses.dataclass
class _Worker:
    handle: Any
    ready_ref: Any = None
    exit_ref: Any = None
    info: dict[str, Any] | None = None


class RayWorkers:
    """The launcher's view of its Ray worker actors: start them, hear of Ready and of deaths, stop them."""

    def __init__(self, cfg, topo, placement: Placement, pg, created_pg: bool, keys: dict[str, bytes],
                 key_dir: str | None):
        self.cfg, self.topo, self.placement, self.pg = cfg, topo, placement, pg
        self.created_pg, self.keys, self.key_dir = created_pg, keys, key_dir
        self.workers: dict[str, _Worker] = {}
        self.gone: set[str] = set()

    @classmethod
    def prepare(cls, cfg, topo) -> "RayWorkers":
        """Connect to Ray, find or make the placement group, plan the workers, make the bus keys; the config the
        launcher's own children then run with is `.cfg` (tcp bus host, key folder). PlacementError: why not."""
        from bus.auth import generate
        from engine.config import launcher_makes_keys

        if not ray.is_initialized():
            ray.init(namespace=NAMESPACE, log_to_driver=True, include_dashboard=False)
        pg, group = _existing_group()
        key = device_key(ray.cluster_resources())
        created = pg is None
        if created:
            bundles = bundles_for(topo, key)
            pg = placement_group(bundles, strategy="PACK")
            try:
                ray.get(pg.ready(), timeout=PG_READY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - GetTimeoutError: not placeable in this cluster
                remove_placement_group(pg)
                raise PlacementError(
                    f"a placement group of {len(bundles)} bundles of {{'{key}': 1}} (one per worker: "
                    f"--tensor-parallel-size {topo.tp} x --data-parallel-size {topo.dp}) was not placed within "
                    f"{PG_READY_TIMEOUT_S:.0f}s; the cluster has {ray.available_resources().get(key, 0):g} {key} free "
                    f"of {ray.cluster_resources().get(key, 0):g}") from None
            group = f"the placement group {pg.id.hex()} made for this engine"
        table = placement_group_table(pg)
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        specs = pg.bundle_specs
        bundle_nodes = [nodes.get(table["bundles_to_node_id"].get(i, ""), "?") for i in range(len(specs))]
        try:
            placement = plan_placement(topo, specs, bundle_nodes, _node_ip(), key, bus_host=cfg.bus.bus_host,
                                       master_addr=cfg.parallel.master_addr, insecure=cfg.bus.bus_insecure, group=group)
        except PlacementError:
            if created:
                remove_placement_group(pg)
            raise
        key_dir = None
        if launcher_makes_keys(cfg):
            key_dir = tempfile.mkdtemp(prefix="rollbus-ray-keys-")
            generate(key_dir, force=True)
        folder = key_dir or cfg.bus.bus_curve_dir
        keys = {} if not folder else {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))
                                       if n.endswith((".key", ".key_secret"))}
        cfg = dataclasses.replace(cfg, bus=dataclasses.replace(cfg.bus, bus_host=placement.bus_host,
                                                               bus_curve_dir=folder))
        return cls(cfg, topo, placement, pg, created, keys, key_dir)

    def describe(self) -> str:
        p = self.placement
        where = ", ".join(f"{s.name}: bundle {s.bundle} on {s.node_ip}" for s in p.slots)
        return f"Ray workers ({p.device_key} bundles): {where}; bus on tcp {p.bus_host}"

    def start(self, name: str, role_argv: list[str], base_argv: list[str]) -> None:
        s = self.placement.slot(name)
        tag = f"{name}@{self.cfg.gateway.port}-{os.getpid()}"  # the actor's name (tests find it by it)
        argv = [*role_argv, *base_argv, "--master-addr", self.placement.master_addrs[s.engine]]
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV) and k not in NOT_FORWARDED}
        options: dict[str, Any] = {
            "name": tag, "namespace": NAMESPACE, "max_concurrency": 4,
            "max_restarts": 0 if self.cfg.bus.max_restarts == 0 else -1, "max_task_retries": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=s.bundle)}
        key = self.placement.device_key
        if key == "GPU":
            options.update(num_cpus=0, num_gpus=1)
        elif key == "NPU":
            options.update(num_cpus=0, resources={"NPU": 1})
        else:
            options.update(num_cpus=1)
        if os.environ.get("PYTHONPATH"):  # rollbus from a source tree: the actor process must import it too
            options["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
        actor = _remote_worker_host().options(**options).remote(
            name, tag, argv, env, self.keys, self.pg.bundle_specs[s.bundle], self.placement.workers_on(s.node_ip))
        self.workers[name] = w = _Worker(actor)
        self._arm(w)

    def _arm(self, w: _Worker) -> None:
        w.ready_ref, w.exit_ref = w.handle.ready.remote(), w.handle.wait_exit.remote()

    def poll(self, timeout_s: float = 0.0) -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
        """(workers that reported Ready, with what they said; workers whose actor died, with Ray's reason)
        since the last call. A dead actor is being restarted by Ray unless it is in `.gone`."""
        refs = {}
        for name, w in self.workers.items():
            if name in self.gone:
                continue
            for ref in (w.ready_ref, w.exit_ref):
                if ref is not None:
                    refs[ref] = name
        if not refs:
            return [], []
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        ready, dead = [], []
        for ref in done:
            name = refs[ref]
            w = self.workers[name]
            if ref is not w.ready_ref and ref is not w.exit_ref:
                continue  # already re-armed after a death seen on the other ref
            try:
                value = ray.get(ref)
            except ray.exceptions.ActorDiedError as e:
                self.gone.add(name)
                dead.append((name, _short(e)))
                continue
            except ray.exceptions.RayError as e:
                if RESTARTING not in str(e):  # a call made while Ray restarts the actor fails at once: not a death
                    dead.append((name, _short(e)))
                self._arm(w)
                continue
            if ref is w.ready_ref:
                w.info, w.ready_ref = value, None
                ready.append((name, value))
            else:
                w.exit_ref = None
        return ready, dead

    def stop(self) -> None:
        """SIGTERM every worker process (STOP_GRACE_S, then SIGKILL), end the actors, free the group and keys."""
        refs = [w.handle.stop.remote() for n, w in self.workers.items() if n not in self.gone]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)
        except Exception:  # noqa: BLE001 - an actor that died meanwhile
            pass
        for w in self.workers.values():
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.created_pg:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        if self.key_dir:
            shutil.rmtree(self.key_dir, ignore_errors=True)


_REMOTE: list[Any] = []


def _remote_worker_host():
    """WorkerHost as a Ray actor class, made once."""
    if not _REMOTE:
        _REMOTE.append(ray.remote(WorkerHost))
    return _REMOTE[0]


def _existing_group():
    """(placement group, how to name it) this engine must use, or (None, None) to make one."""
    pg = ray.util.get_current_placement_group()
    if pg is not None:
        return pg, f"the current placement group {pg.id.hex()}"
    hex_id = os.environ.get(PG_ENV, "").strip()
    if hex_id:
        try:
            pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hex_id)))
            ray.get(pg.ready(), timeout=PG_READY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise PlacementError(f"{PG_ENV}={hex_id}: not a ready placement group of this cluster ({_short(e)})") \
                from None
        return pg, f"the placement group {hex_id} ({PG_ENV})"
    return None, None


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"
