"""Where every socket lives. The one table of the bus:

| field    | binds (socket)        | connects (socket)              | flows                                   |
|----------|-----------------------|--------------------------------|-----------------------------------------|
| requests | scheduler (ROUTER)    | gateways (DEALER)              | AddRequest/AbortRequests in; OutputBatch back to the sending gateway |
| plans    | scheduler (XPUB)      | workers (SUB)                  | StepPlan, topic b"P"                    |
| results  | scheduler (PULL)      | workers (PUSH)                 | Hello (worker's KV capacity), StepResult |
| control  | coordinator (ROUTER)  | everyone (DEALER)              | Hello/Heartbeat/Ack/ControlRequest in; Welcome/ControlReply out |
| commands | coordinator (XPUB)    | everyone (SUB)                 | Command (seq-numbered), coordinator Heartbeat, topic b"C" |
| ready    | launcher (PULL)       | every process (PUSH), optional | Ready                                   |

Data parallelism (-dp M, engine.topology): requests, plans and results exist once per engine, bound by that
engine's scheduler (engine e >= 1: `<name>-e` in the ipc folder, tcp ports base + 3e + 2 .. base + 3e + 4,
on --bus-engine-hosts' e-th host); control and commands stay one for the whole deployment.

Subscribers also subscribe to a topic naming themselves (b"@" + name) that nothing is published on:
the XPUB side sees that subscription arrive, so it knows the member's SUB pipe is connected before it
sends anything that member must not miss (no sleeps for slow joiners), and sees it leave when the member
disconnects.

High-water marks: request/plan/command sockets keep the zmq default (1000 messages); a slow subscriber
that hits it loses messages, which the seq numbers turn into a detected gap and a resync.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
from dataclasses import dataclass

from bus import auth, frame_limits

PLAN_TOPIC = b"P"
COMMAND_TOPIC = b"C"
WEIGHTS_TOPIC = b"W"  # WeightVersionCommitted, for trainers and monitors


_PER_ENGINE = ("requests", "plans", "results")  # one of each per engine: <name>-<engine> for engines >= 1
_SHARED = ("control", "commands")  # the coordinator's, one for the whole deployment


def presence_topic(name: str) -> bytes:
    return b"@" + name.encode()


@dataclass(frozen=True, slots=True)
class Endpoints:
    requests: str
    plans: str
    results: str
    control: str
    commands: str
    ready: str | None = None
    keys: auth.BusKeys | None = None  # tcp: the CURVE keys (None: ipc, or tcp with --bus-insecure)
    max_frames: tuple[tuple[str, int], ...] = ()  # (address, largest frame it accepts): bus.frame_limits
    # (requests, plans, results) of every engine (data parallelism, bus.topology); the three fields
    # above are those of the engine named by --data-parallel-rank
    engines: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def from_config(cls, cfg) -> "Endpoints":
        """The engine's own processes: tcp needs --bus-curve-dir (or --bus-insecure on loopback)."""
        from bus.topology import Topology

        topo = Topology.from_config(cfg)
        keys = auth.check_config(cfg)
        if cfg.bus.bus_transport == "tcp":
            shared = [f"tcp://{_tcp_host(cfg.bus.bus_host)}:{cfg.bus.bus_port_base + i}" for i in (3, 4)]
            hosts = [h.strip() for h in (cfg.bus.bus_engine_hosts or "").split(",") if h.strip()]
            hosts = hosts if len(hosts) == topo.dp else [cfg.bus.bus_host] * topo.dp  # (config_from_args checks it)
            engines = [tuple(f"tcp://{_tcp_host(hosts[e])}:{cfg.bus.bus_port_base + topo.port_offset(e) + i}"
                             for i in range(3)) for e in topo.engines]
        else:
            folder = cfg.bus.bus_dir or os.path.join(tempfile.gettempdir(), f"rollbus-{os.getuid()}-{cfg.gateway.port}")
            shared, engines = _ipc_addresses(folder, topo)
        if cfg.bus.bus_transport == "tcp" and keys is None:
            auth.log.warning("bus.insecure", host=cfg.bus.bus_host,
                             detail="--bus-insecure: the tcp bus is unauthenticated and unencrypted; any local "
                                    "user can pause, sleep or update the engine. Use --bus-curve-dir.")
        limits = frame_limits.limits_for(cfg)
        named = [(n, a) for e in engines for n, a in zip(_PER_ENGINE, e)] + list(zip(_SHARED, shared))
        own = engines[min(cfg.parallel.data_parallel_rank, len(engines) - 1)]
        return cls(*own, *shared, ready=cfg.bus.ready_endpoint, keys=keys,
                   max_frames=tuple((a, limits[n]) for n, a in named), engines=tuple(engines))

    def engine(self, index: int) -> "Endpoints":
        """These endpoints with engine `index`'s requests, plans and results."""
        if not self.engines:
            return self
        return dataclasses.replace(self, **dict(zip(_PER_ENGINE, self.engines[index])))

    def all_addresses(self) -> list[str]:
        """Every socket address of the bus (the launcher removes the ipc files at exit)."""
        return [a for e in self.engines for a in e] + [self.control, self.commands]

    @classmethod
    def from_url(cls, url: str, *, curve_dir: str | None = None, insecure: bool | None = None) -> "Endpoints":
        """A bus named as a client knows it: "tcp://HOST:PORT_BASE" (--bus-host, --bus-port-base) or
        "ipc:///FOLDER" (--bus-dir; default /tmp/rollbus-<uid>-<http port>). tcp needs the client keys:
        curve_dir (default: env ROLLBUS_BUS_CURVE_DIR) with server.key and client.key_secret, or
        insecure=True (default: env ROLLBUS_BUS_INSECURE=1) for an engine started with --bus-insecure."""
        if url.startswith("tcp://"):
            host, _, port = url[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bus url {url!r}: expected tcp://HOST:PORT_BASE")
            curve_dir = curve_dir or os.environ.get(auth.ENV_DIR) or None
            insecure = auth.env_insecure() if insecure is None else insecure
            if curve_dir:
                keys = auth.load(curve_dir, server=False)
            elif insecure:
                keys = None
            else:
                raise ValueError(f"bus {url}: a tcp bus needs the client keys: pass the key folder "
                                 f"(`rollbus keys DIR`) or set {auth.ENV_DIR}")
            names = ("requests", "plans", "results", "control", "commands")
            return cls(*[f"tcp://{host}:{int(port) + i}" for i in range(len(names))], keys=keys)
        if url.startswith("ipc://"):  # a client connects only: no keys, no frame limits (those are the binder's)
            from bus.topology import Topology

            shared, engines = _ipc_addresses(url[len("ipc://"):], Topology())
            return cls(*engines[0], *shared, engines=tuple(engines))
        raise ValueError(f"bus url {url!r}: expected tcp://HOST:PORT_BASE or ipc:///FOLDER")

    def secure(self, ctx) -> "Endpoints":
        """Every tcp socket bus.sockets.make_socket makes in ctx uses these endpoints' keys; every socket it
        binds, the frame limit of its address."""
        auth.attach(ctx, self.keys)
        frame_limits.attach(ctx, dict(self.max_frames))
        return self

    def bind_address(self, addr: str) -> str:
        """Where a binding socket listens: exactly the address in the table. tcp binds --bus-host only
        (never all interfaces); ipc binds the path itself."""
        return addr


def _tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def private_folder(folder: str) -> None:
    """The ipc socket folder: created 0700; an existing one must be ours and closed to other users."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"bus folder {folder} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}) "
                              "is open to other users: use a folder of your own with mode 0700 (chmod 700)")


def _ipc_addresses(folder: str, topo) -> tuple[list[str], list[tuple[str, ...]]]:
    """The shared and per-engine ipc socket addresses in `folder` (created private if missing)."""
    private_folder(folder)
    shared = [f"ipc://{os.path.join(folder, n)}" for n in _SHARED]
    engines = [tuple(f"ipc://{os.path.join(folder, n + topo.endpoint_suffix(e))}" for n in _PER_ENGINE)
               for e in topo.engines]
    return shared, engines
