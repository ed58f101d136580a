"""vllm-router (PyPI `vllm-router`, a Rust binary in the wheel) in front of `rollbus serve` engines, for the
`fleet` tests and bench/fleet_routing.py. The router lives in its own venv, never in the project's Python:
`bash tests/interop/setup_venvs.sh router` builds ~/.cache/rollbus-fleet/router (ROLLBUS_FLEET_VENVS
overrides the parent folder)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.serve_process import Server, free_port

SETUP = "bash tests/interop/setup_venvs.sh router"


def fleet_venvs() -> Path:
    return Path(os.environ.get("ROLLBUS_FLEET_VENVS", Path.home() / ".cache" / "rollbus-fleet"))


def router_binary() -> Path | None:
    exe = fleet_venvs() / "router" / "bin" / "vllm-router"
    return exe if exe.is_file() else None


Router = Server  # a process on a port with a log: the same handle as a `rollbus serve`


def start_router(workdir: Path, worker_urls: list[str], policy: str, *, kv_sources: dict[str, str] | None = None,
                 model: str | None = None, block_size: int = 16, extra: tuple[str, ...] = (),
                 timeout_s: float = 60.0, prometheus_port: int | None = None) -> Router:
    """`vllm-router --policy POLICY` over worker_urls on a free port; kv_sources maps a worker URL to its KV
    event endpoint (kv_aware, which needs the served model's name too); its metrics (vllm_router_worker_health
    per worker) on prometheus_port, if given. Returns once the router answers
    /health (it waits for its workers first)."""
    exe = router_binary()
    if exe is None:
        raise RuntimeError(f"vllm-router is not installed: {SETUP}")
    port = free_port()
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls,
           "--prometheus-port", str(prometheus_port or free_port()),
           *(() if "--health-check-interval-secs" in extra else ("--health-check-interval-secs", "2")),
           "--log-level", os.environ.get("ROLLBUS_ROUTER_LOG_LEVEL", "info"), *extra]
    for url, endpoint in (kv_sources or {}).items():
        cmd += ["--kv-event-source", f"{url}={endpoint}"]
    if kv_sources:
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model or ""]
    log_path = workdir / f"router-{port}.log"
    f = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    router = Router(proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n{router.log()[-3000:]}")
        try:
            if httpx.get(router.url + "/health", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"vllm-router not ready after {timeout_s}s:\n{router.log()[-3000:]}")
