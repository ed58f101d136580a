"""Where the workers of `rollbus serve --distributed-executor-backend ray` go, and what each one's process
sees. Pure: no Ray, no sockets (engine.fleet.ray_executor feeds it what Ray says).

- The device resource: NPU when the cluster has NPUs, else GPU (on a CPU-only cluster declared with logical
  GPUs, `ray.init(num_gpus=2)`, each logical GPU is one CPU worker), else CPU.
- Worker g (bus.topology: engine e, tp rank t, g = e x tp + t) takes the g-th bundle that holds one of that
  resource, in bundle order; fewer such bundles than workers is refused, naming both counts.
- The bus is tcp. Its binding sockets (coordinator, schedulers) run beside the launcher; when a worker runs on
  another node and --bus-host is a loopback address, they listen on the launcher's node address instead
  (never on all interfaces), and --bus-insecure is refused: the keys are then the only access control.
- An engine whose workers span nodes rendezvouses its tp group on the node of its tp rank 0 (that node's
  address as --master-addr) unless --master-addr names a non-loopback address already.
- A worker process sees only its bundle's devices (CUDA_VISIBLE_DEVICES from the bundle's GPU ids,
  ASCEND_RT_VISIBLE_DEVICES from its NPU ids) and uses the first (`rollbus worker --device-index 0`); on a node
  without an accelerator it runs on the CPU with its share of the cores (OMP_NUM_THREADS: the bundle's CPUs,
  else the node's cores over the workers placed on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.auth import is_loopback
from bus.topology import Topology

DEVICE_VARS = {"GPU": "CUDA_VISIBLE_DEVICES", "NPU": "ASCEND_RT_VISIBLE_DEVICES"}
HIDDEN_DEVICE_VARS = (
    "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class PlacementError(ValueError):
    """The placement group or the flags cannot hold this engine; the message names the counts or the flag."""


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    name: str  # bus name, worker-<g>
    engine: int
    rank: int  # tensor-parallel rank inside the engine
    bundle: int  # placement group bundle index
    node_ip: str


@dataclass(frozen=True, slots=True)
class Placement:
    device_key: str  # the resource each worker actor takes from its bundle: "GPU", "NPU" or "CPU"
    slots: tuple[WorkerSlot, ...]
    bus_host: str
    master_addrs: tuple[str, ...]  # per engine

    def slot(self, name: str) -> WorkerSlot:
        return next(s for s in self.slots if s.name == name)

    def workers_on(self, node_ip: str) -> int:
        return sum(s.node_ip == node_ip for s in self.slots)

    @property
    def spans_nodes(self) -> bool:
        return len({s.node_ip for s in self.slots}) > 1


def device_key(cluster_resources: dict[str, float]) -> str:
    for key in ("NPU", "GPU"):
        if cluster_resources.get(key, 0) >= 1:
            return key
    return "CPU"


def bundles_for(topo: Topology, key: str) -> list[dict[str, float]]:
    """The bundles of a placement group made for this engine: one per worker, one device (or one CPU) each."""
    return [{key: 1.0} for _ in range(topo.world_size)]


def plan(topo: Topology, bundles: list[dict[str, float]], bundle_nodes: list[str], head_ip: str, key: str, *,
         bus_host: str, master_addr: str, insecure: bool, group: str = "the placement group") -> Placement:
    """Every worker's bundle, the bus host and each engine's rendezvous address (PlacementError: why not)."""
    usable = [i for i, b in enumerate(bundles) if b.get(key, 0) >= 1]
    need = topo.world_size
    if len(usable) < need:
        raise PlacementError(
            f"{group} has {len(usable)} bundle(s) with a {key} (of {len(bundles)} bundles); --tensor-parallel-size "
            f"{topo.tp} x --data-parallel-size {topo.dp} needs {need}, one per worker")
    slots = []
    for e in topo.engines:
        for t in range(topo.tp):
            b = usable[topo.worker_index(e, t)]
            slots.append(WorkerSlot(topo.worker_name(e, t), e, t, b, bundle_nodes[b]))
    remote = sorted({s.node_ip for s in slots} - {head_ip})
    if remote and is_loopback(bus_host):
        if insecure:
            raise PlacementError(f"--bus-insecure is refused: workers are placed on other hosts ({', '.join(remote)}) "
                                 "and an unauthenticated bus may only listen on a loopback address; drop it (the "
                                 "launcher makes CURVE keys) or pass --bus-curve-dir")
        bus_host = head_ip
    masters = []
    for e in topo.engines:
        mine = [s for s in slots if s.engine == e]
        spans = len({s.node_ip for s in mine}) > 1
        masters.append(mine[0].node_ip if spans and is_loopback(master_addr) else master_addr)
    return Placement(key, tuple(slots), bus_host, tuple(masters))


# ------------------------------------------------------------------------------ the worker process's environment


def device_env(accelerator_ids: dict[str, list[str]], *, accelerator: bool, bundle: dict[str, float],
               cpu_count: int, workers_on_node: int, environ: dict[str, str]) -> dict[str, str | None]:
    """What to set (None: remove) in a worker process's environment: its bundle's devices, or its CPU share."""
    out: dict[str, str | None] = {var: None for var in HIDDEN_DEVICE_VARS}
    if accelerator:
        for key, var in DEVICE_VARS.items():
            if accelerator_ids.get(key):
                out[var] = ",".join(map(str, accelerator_ids[key]))
        return out
    if "OMP_NUM_THREADS" not in environ:
        cpus = int(bundle.get("CPU", 0))
        out["OMP_NUM_THREADS"] = str(cpus if cpus >= 1 else max(1, cpu_count // max(1, workers_on_node)))
    return out
