"""Where every socket lives. The one table of the bus:

| field    | binds (socket)        | connects (socket)              | flows                                   |
|----------|-----------------------|--------------------------------|-----------------------------------------|
| requests | scheduler (ROUTER)    | gateways (DEALER)              | AddRequest/AbortRequests in; OutputBatch back to the sending gateway |
| plans    | scheduler (XPUB)      | workers (SUB)                  | StepPlan, topic b"P"                    |
| results  | scheduler (PULL)      | workers (PUSH)                 | Hello (worker's KV capacity), StepResult |
| control  | coordinator (ROUTER)  | everyone (DEALER)              | Hello/Heartbeat/Ack/ControlRequest in; Welcome/ControlReply out |
| commands | coordinator (XPUB)    | everyone (SUB)                 | Command (seq-numbered), coordinator Heartbeat, topic b"C" |
| ready    | launcher (PULL)       | every process (PUSH), optional | Ready                                   |

Subscribers also subscribe to a topic naming themselves (b"@" + name) that nothing is published on:
the XPUB side sees that subscription arrive, so it knows the member's SUB pipe is connected before it
sends anything that member must not miss (no sleeps for slow joiners), and sees it leave when the member
disconnects.

High-water marks: request/plan/command sockets keep the zmq default (1000 messages); a slow subscriber
that hits it loses messages, which the seq numbers turn into a detected gap and a resync.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

PLAN_TOPIC = b"P"
COMMAND_TOPIC = b"C"
WEIGHTS_TOPIC = b"W"  # WeightVersionCommitted, for trainers and monitors


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

    @classmethod
    def from_config(cls, cfg) -> "Endpoints":
        names = ("requests", "plans", "results", "control", "commands")
        if cfg.bus_transport == "tcp":
            addrs = [f"tcp://{cfg.bus_host}:{cfg.bus_port_base + i}" for i in range(len(names))]
        else:
            folder = cfg.bus_dir or os.path.join(tempfile.gettempdir(), f"rollbus-{os.getuid()}-{cfg.port}")
            os.makedirs(folder, mode=0o700, exist_ok=True)
            addrs = [f"ipc://{os.path.join(folder, n)}" for n in names]
        return cls(*addrs, ready=cfg.ready_endpoint)

    @classmethod
    def from_url(cls, url: str) -> "Endpoints":
        """A bus named as a client knows it: "tcp://HOST:PORT_BASE" (--bus-host, --bus-port-base) or
        "ipc:///FOLDER" (--bus-dir; default /tmp/rollbus-<uid>-<http port>)."""
        from types import SimpleNamespace

        if url.startswith("tcp://"):
            host, _, port = url[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bus url {url!r}: expected tcp://HOST:PORT_BASE")
            return cls.from_config(SimpleNamespace(bus_transport="tcp", bus_host=host, bus_port_base=int(port),
                                                   ready_endpoint=None))
        if url.startswith("ipc://"):
            return cls.from_config(SimpleNamespace(bus_transport="ipc", bus_dir=url[len("ipc://"):], port=0,
                                                   ready_endpoint=None))
        raise ValueError(f"bus url {url!r}: expected tcp://HOST:PORT_BASE or ipc:///FOLDER")

    def bind_address(self, addr: str) -> str:
        """tcp endpoints bind on all interfaces of the host named in them; ipc binds the path itself."""
        if addr.startswith("tcp://"):
            return "tcp://*:" + addr.rsplit(":", 1)[1]
        return addr
