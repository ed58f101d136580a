"""The ZeroMQ bus between the processes and their supervision: transport, endpoints, keys, heartbeats,
control deadlines and restarts (bus.endpoints, bus.auth, engine.launcher).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.argv import Switch


@dataclass(slots=True)
class BusConfig:
    bus_transport: str = "ipc"  # ipc | tcp
    bus_dir: str | None = None  # ipc socket folder (default: a per-port folder under the temp dir)
    bus_host: str = "127.0.0.1"  # tcp: where the binding processes listen / are reached
    bus_port_base: int = 5550  # tcp: first of a small block of consecutive ports
    bus_engine_hosts: str | None = None  # tcp: comma-separated host of each engine's scheduler (default --bus-host)
    bus_curve_dir: str | None = None  # tcp: CURVE key folder (`rollbus keys DIR`); see bus.auth
    bus_insecure: bool = False  # tcp without keys: loopback --bus-host only
    ready_endpoint: str | None = None  # set by `rollbus serve`: where processes report READY
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    control_timeout_s: float = 10.0
    max_restarts: int = 5  # rollbus serve: restarts of one child within RESTART_WINDOW_S before it gives up


def add_args(p: argparse.ArgumentParser) -> None:
    d = BusConfig()
    g = p.add_argument_group("bus")
    g.add_argument("--bus-transport", default=os.environ.get("ROLLBUS_BUS_TRANSPORT") or None,
                   choices=["ipc", "tcp"],
                   help="ipc:// sockets (one host) or tcp:// (processes on several hosts). Env ROLLBUS_BUS_TRANSPORT. "
                        "Default: ipc; tcp with --distributed-executor-backend ray.")
    g.add_argument("--bus-dir", default=os.environ.get("ROLLBUS_BUS_DIR"),
                   help="Folder for ipc:// sockets (refused with --bus-transport tcp). Env ROLLBUS_BUS_DIR. Default: a "
                        "folder per --port in the temp dir.")
    g.add_argument("--bus-host", default=os.environ.get("ROLLBUS_BUS_HOST", d.bus_host),
                   help="tcp: host of the scheduler and coordinator sockets. Env ROLLBUS_BUS_HOST.")
    g.add_argument("--bus-port-base", type=int, default=int(os.environ.get("ROLLBUS_BUS_PORT_BASE", d.bus_port_base)),
                   help="tcp: first of 5 consecutive ports. Env ROLLBUS_BUS_PORT_BASE.")
    g.add_argument("--bus-engine-hosts", default=None, metavar="HOST,HOST,...",
                   help="tcp with several hosts: the host of each engine's scheduler, one per engine in rank order "
                        "(e.g. 10.0.0.1,10.0.0.2 with -dp 2): that scheduler binds its requests, plans and results "
                        "sockets there and everyone connects to it there. Default: --bus-host for every engine. "
                        "The coordinator always listens on --bus-host.")
    g.add_argument("--bus-curve-dir", default=os.environ.get("ROLLBUS_BUS_CURVE_DIR") or None,
                   help="tcp: folder of the bus's CURVE keys, made by `rollbus keys DIR` (server.key, "
                        "server.key_secret, client.key, client.key_secret; extra *.key files: more allowed "
                        "clients). Every tcp socket is encrypted and only holders of an allowed client key "
                        "may connect. Required with --bus-transport tcp unless --bus-insecure. "
                        "Env ROLLBUS_BUS_CURVE_DIR.")
    g.add_argument("--bus-insecure", action=Switch, default=False,
                   help="tcp: run the bus without keys, unauthenticated and unencrypted (a warning is "
                        "logged). Only with a loopback --bus-host; refused otherwise.")
    g.add_argument("--ready-endpoint", default=None, help=argparse.SUPPRESS)
    g.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                   help="Seconds between heartbeats on the bus.")
    g.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s,
                   help="A process silent this long is declared dead; its requests fail.")
    g.add_argument("--control-timeout-s", type=float, default=d.control_timeout_s,
                   help="Deadline for every member to ack a control command.")
    g.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="rollbus serve: a child (worker, scheduler, gateway) that dies is restarted, at most "
                        "this many times within 60 s (with a growing delay between tries); one more death "
                        "stops everything with exit code 1. 0: never restart (any death stops everything).")


def engine_hosts(cfg: BusConfig, engines: int) -> list[str]:
    """The tcp host of each engine's scheduler sockets (--bus-engine-hosts, else --bus-host for all)."""
    if not cfg.bus_engine_hosts:
        return [cfg.bus_host] * engines
    return [h.strip() for h in cfg.bus_engine_hosts.split(",")]


def engine_host_problems(cfg: BusConfig, engines: int) -> list[str]:
    if not cfg.bus_engine_hosts:
        return []
    from bus.auth import is_loopback

    hosts = engine_hosts(cfg, engines)
    out = []
    if cfg.bus_transport != "tcp":
        out.append("--bus-engine-hosts needs --bus-transport tcp")
    if len(hosts) != engines or not all(hosts):
        out.append(f"--bus-engine-hosts {cfg.bus_engine_hosts} names {len(hosts)} host(s); --data-parallel-size "
                   f"{engines} needs one per engine")
    if cfg.bus_insecure and not all(is_loopback(h) for h in hosts):
        out.append(f"--bus-insecure is refused with --bus-engine-hosts {cfg.bus_engine_hosts}: an unauthenticated "
                   "bus may only listen on loopback addresses; use --bus-curve-dir")
    return out
