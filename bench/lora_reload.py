"""In-place reload of a LoRA adapter, end to end from the client's view, through `rollbus serve` (SmolLM2,
every projection, rank 16 by default): the two ways an RL trainer refreshes its policy adapter after a step.

- **push** (the weight-transfer path, no folder): `WeightSyncClient.send_lora(name, tensors, config)` over
  ipc; it returns once every worker has built the new version (the commit), so its wall time is the reload.
- **file**: `POST /v1/load_lora_adapter {"load_inplace": true}`; the answer comes once the gateway checked
  the folder, and each worker reads the new version when the first request needs it, so the reload is that
  call plus what the first request on the new version costs beyond a request on a version already built
  (a 1-token completion, timed right after, on the same version). On a loaded host that difference drowns in
  the requests' own noise, so the table also gives the worker's read + build of a version measured in this
  process on CPU time, and the call plus that.

    python bench/lora_reload.py                     # 12 reloads each way, medians
    python bench/lora_reload.py --reloads 20 --rank 16

Each reload alternates between two random adapters, so every version differs from the one before it. Prints
one table of medians (and min / max). Needs peft (the adapters are random PEFT folders under a temp folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_time import cpu_seconds  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient  # noqa: E402
from tests.lora_helpers import make_adapter  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

RL = '{"rl_config": {"enabled": true}}'


def complete(client: httpx.Client, url: str, model: str) -> dict:
    r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                   "max_tokens": 1, "temperature": 0,
                                                   "return_weight_versions": True})
    r.raise_for_status()
    return r.json()["choices"][0]


def lora_version(choice: dict) -> int:
    return choice["weight_versions"][0]["lora_version"]


def worker_build_ms(base: Path, folder: Path, rank: int, n: int) -> list[float]:
    """What the first request on a new version pays on a worker beyond an ordinary request: reading the folder
    and building the version (workers/lora.py), in this process on one thread's CPU time (a loaded host's
    wall time buries it in the request's own noise)."""
    import torch

    from bus.sampling_params import LoraRef
    from workers.lora import AdapterWeights

    hf = json.loads((base / "config.json").read_text())
    out = []
    for i in range(n):
        t0 = time.thread_time()
        AdapterWeights.from_folder(LoraRef(1, "x", str(folder), i + 1), hf, rank, torch.float32,
                                   torch.device("cpu"), True)
        out.append(ms(time.thread_time() - t0))
    return out


def ms(seconds: float) -> float:
    return 1e3 * seconds


def row(name: str, values: list[float], bar: float | None = None) -> str:
    med = statistics.median(values)
    verdict = "" if bar is None else ("met" if med <= bar else "NOT met")
    return (f"| {name} | {med:.1f} | {min(values):.1f} | {max(values):.1f} | "
            f"{'' if bar is None else f'<= {bar:.0f}'} | {verdict} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reloads", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="reloads each way not counted")
    ap.add_argument("--log", type=Path, help="copy the server's log here (it is in a temporary folder)")
    args = ap.parse_args()
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    base = resolve_model(None, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = [make_adapter(base, root / f"a{i}", rank=args.rank, alpha=2 * args.rank, seed=i, std=0.01)
                   for i in range(2)]
        from safetensors.torch import load_file

        pushed = [(load_file(str(f / "adapter_model.safetensors")), json.loads((f / "adapter_config.json").read_text()))
                  for f in folders]
        server = start_server(root, str(base), "--enable-lora", "--max-lora-rank", str(args.rank),
                              "--max-loras", "2", "--max-cpu-loras", "4",
                              "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "2048",
                              "--additional-config", RL,
                              "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 60}')
        sync = WeightSyncClient(server.url, backend="ipc")
        http = httpx.Client(timeout=120)
        try:
            pids = [server.proc.pid, *server.child_pids().values()]
            push, phases, push_cpu, file_cpu = [], {}, [], []
            for i in range(args.warmup + args.reloads):
                tensors, conf = pushed[i % 2]
                c0, p0 = cpu_seconds(pids), time.process_time()
                t0 = time.perf_counter()
                ph = sync.send_lora("pushed", tensors.items(), conf)
                dt = time.perf_counter() - t0
                cpu = (cpu_seconds(pids) - c0, time.process_time() - p0)
                assert lora_version(complete(http, server.url, "pushed")) == i + 1
                if i >= args.warmup:
                    push.append(ms(dt))
                    push_cpu.append(tuple(map(ms, cpu)))
                    for k, v in (ph or {}).items():
                        phases.setdefault(k, []).append(ms(v))
            r = http.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": "fromfile", "lora_path": str(folders[0])})
            r.raise_for_status()
            complete(http, server.url, "fromfile")
            load, first, warm, file_e2e = [], [], [], []
            for i in range(args.warmup + args.reloads):
                c0 = cpu_seconds(pids)
                t0 = time.perf_counter()
                r = http.post(f"{server.url}/v1/load_lora_adapter",
                              json={"lora_name": "fromfile", "lora_path": str(folders[(i + 1) % 2]),
                                    "load_inplace": True})
                r.raise_for_status()
                t1 = time.perf_counter()
                c = complete(http, server.url, "fromfile")
                t2 = time.perf_counter()
                c2 = cpu_seconds(pids)
                complete(http, server.url, "fromfile")
                t3 = time.perf_counter()
                c3 = cpu_seconds(pids)
                assert lora_version(c) == i + 2, c
                if i >= args.warmup:
                    load.append(ms(t1 - t0))
                    first.append(ms(t2 - t1))
                    warm.append(ms(t3 - t2))
                    file_e2e.append(ms((t1 - t0) + max(0.0, (t2 - t1) - (t3 - t2))))
                    file_cpu.append(ms(max(0.0, (c2 - c0) - (c3 - c2))))
            build = worker_build_ms(base, folders[0], args.rank, args.warmup + args.reloads)[args.warmup:]
        finally:
            http.close()
            sync.close()
            server.stop()
            if args.log:
                args.log.write_text(server.log())
    print(f"\nSmolLM2, rank-{args.rank} adapter on every projection, {args.reloads} in-place reloads each way, "
          f"load average {os.getloadavg()[0]:.1f} (ms):\n")
    print("| reload | median | min | max | bar | |\n|---|---|---|---|---|---|")
    print(row("push (send_lora), end to end", push, 50))
    for k, v in phases.items():
        print(row(f"  push phase: {k}", v))
    print(row("file: load_lora_adapter call", load))
    print(row("file: first 1-token request on the new version", first))
    print(row("file: next 1-token request (version built)", warm))
    print(row("file, end to end (call + first - next)", file_e2e, 200))
    print(row("push: server CPU (all its processes)", [c for c, _ in push_cpu]))
    print(row("push: trainer's CPU (send_lora's process)", [c for _, c in push_cpu]))
    print(row("file: server CPU (call + first - next)", file_cpu))
    print(row("file: a worker's read + build of the version (CPU)", build))
    print(row("file: call + worker's build", [c + b for c, b in zip(load, build)], 200))


if __name__ == "__main__":
    main()
