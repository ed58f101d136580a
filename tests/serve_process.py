"""Run `rollbus serve` as a child process and wait until it is ready: for tests, benchmarks and
trainers that launch the engine from Python."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ascend_ops.host_env import HUGE_PAGES_ENV


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range (see free_port_range)."""
    return free_port_range(1)


def _ephemeral_ports() -> range:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    return range(lo, hi + 1)


def free_port_range(n: int, avoid: range = range(0)) -> int:
    """A base port whose n consecutive ports are all free now and outside `avoid` (a tcp bus binds base + i
    for each socket: one free port says nothing of the others). The range lies below the kernel's ephemeral
    ports: every outgoing connection takes one of those, so a port picked there can be taken between this
    check and the engine's bind (CI saw it: 'Address already in use' on base + 4)."""
    import random

    eph = _ephemeral_ports()
    low, high = 10000, max(10000 + n + 1, eph.start - n)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while True:
        base = rng.randrange(low, high)
        ports = range(base, base + n)
        if any(p in avoid or p in eph for p in ports):
            continue
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base


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
                out[_member_name(args, args[args.index("engine.cli") + 1])] = int(pid)
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


def _member_name(args: list[str], role: str) -> str:
    """A child's bus name from its argv (bus.topology's names: worker-<dp rank x tp + tp rank>,
    scheduler-<dp rank> with more than one engine)."""
    def flag(name: str, default: int) -> int:
        return int(args[args.index(name) + 1]) if name in args else default

    engine, dp, tp = flag("--data-parallel-rank", 0), flag("--data-parallel-size", 1), flag("--tensor-parallel-size", 1)
    if role == "worker":
        return f"worker-{engine * tp + flag('--rank', 0)}"
    if role == "scheduler" and dp > 1:
        return f"scheduler-{engine}"
    return role


# Set by tests/conftest.py (pytest only; benchmarks keep the engine's defaults): a server started without a KV
# size of its own gets a cache sized for tests (kv_cache_bytes_for_tests), not the CPU default of 1 GiB,
# which every start would fault in whole (about 3.6 s per GiB on the CI machine).
SIZE_KV_FOR_TESTS = False
TEST_KV_TOKENS = 8192  # the least a test server's cache holds, in tokens (and at least 4 max-length sequences)
_KV_FLAGS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")


def kv_cache_bytes_for_tests(args: tuple[str, ...] | list[str]) -> int | None:
    """The --kv-cache-memory-bytes a test server gets when its flags size no KV cache: room for
    max(4 x max-model-len, TEST_KV_TOKENS) tokens at fp32 with every KV head (each worker's share is
    smaller). None (the engine's own sizing) when that is not below the CPU default, the flags or a
    --config file size the cache, VLLM_CPU_KVCACHE_SPACE is set, the flags do not parse, or the model is not a
    folder with a config.json (a .gguf file)."""
    import torch

    from engine.config import CPU_KV_SPACE_ENV, parse_config
    from workers.kv_cache import CPU_DEFAULT_KV_BYTES, KVCache

    if os.environ.get(CPU_KV_SPACE_ENV):
        return None
    try:
        cfg = parse_config(list(args))
    except (SystemExit, ValueError, OSError):
        return None  # the server itself reports it
    if any(cfg.flags()[name] is not None for name in _KV_FLAGS):
        return None
    if cfg.model.model is None:
        from engine.model_store import resolve_model

        folder = resolve_model(None, progress=False)
    else:
        folder = Path(cfg.model.model)
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = hf["num_attention_heads"]
    bytes_per_token = KVCache.bytes_per_block(hf["num_hidden_layers"], hf.get("num_key_value_heads") or heads,
                                              hf.get("head_dim") or hf["hidden_size"] // heads, 1, torch.float32)
    max_len = cfg.model.max_model_len or int(hf.get("max_position_embeddings", 2048))
    tokens = max(4 * max_len, TEST_KV_TOKENS)
    tokens = -(-tokens // cfg.cache.block_size) * cfg.cache.block_size
    return tokens * bytes_per_token if tokens * bytes_per_token < CPU_DEFAULT_KV_BYTES else None


def sized_for_tests(cfg):
    """An EngineConfig whose roles a test starts itself (engine.cli <role> *cfg.to_argv()), with
    kv_cache_bytes_for_tests when SIZE_KV_FOR_TESTS is on and its fields size no KV cache."""
    import dataclasses

    kv = kv_cache_bytes_for_tests(cfg.to_argv()) if SIZE_KV_FOR_TESTS else None
    if kv is None:
        return cfg
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_memory_bytes=kv))


def start_server(workdir: Path, *args: str, timeout_s: float = 180.0, env: dict[str, str] | None = None) -> Server:
    """`rollbus serve *args` on a free port, its log and bus sockets under workdir, with `env` over this
    process's environment. Under pytest (SIZE_KV_FOR_TESTS), a server whose flags size no KV cache gets
    kv_cache_bytes_for_tests."""
    if SIZE_KV_FOR_TESTS and (kv := kv_cache_bytes_for_tests(args)) is not None:
        args = (*args, "--kv-cache-memory-bytes", str(kv))
    port = free_port()
    log_path = workdir / f"serve-{port}.log"
    bus_dir = workdir / f"bus-{port}"
    ipc = ["--bus-dir", str(bus_dir)] if "tcp" not in args else []  # --bus-dir is for ipc sockets only
    # tests: a short heartbeat timeout finds killed processes fast; benches (not under pytest): a busy host's slow
    # step must not become a lost worker. A caller's own --heartbeat-timeout-s wins either way.
    beat = [] if any(a.startswith("--heartbeat-timeout-s") for a in args) else \
        ["--heartbeat-timeout-s", "3" if SIZE_KV_FOR_TESTS else "30"]
    cmd = [sys.executable, "-m", "engine.cli", "serve", *args, "--port", str(port), *ipc, *beat]
    if SIZE_KV_FOR_TESTS and HUGE_PAGES_ENV not in {**os.environ, **(env or {})}:
        # pytest: the workers' malloc on 4 KiB pages, unless the test asks for huge pages (the product's
        # default, which tests/test_host_allocator.py and the ipc server of tests/test_weight_sync.py keep
        # checking): a host whose huge pages fault in slowly spent 5 s of a SmolLM2 start in the warm-up's
        # packing (0.3 s on 4 KiB pages), once per server
        env = {**(env or {}), HUGE_PAGES_ENV: "0"}
    f = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=None if env is None else {**os.environ, **env})
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollbus serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
        if "rollbus: ready" in server.log():
            return server
        time.sleep(0.05)  # a lane starts ~90 servers: a 0.2 s poll cost each ~0.1 s on average
    server.stop()
    raise RuntimeError(f"rollbus serve not ready after {timeout_s}s:\n{server.log()[-4000:]}")
