"""Weight sync to a fleet (issue 33, item 5): one update to 2 engines against the same update to 1 engine.

Three `rollbus serve` engines with the collective backend (Gloo on CPU); the trainer's copy in this process.
Each round times WeightSyncClient(url_a).send_weights(...) and WeightSyncClient([url_b, url_c]).send_weights(...)
back to back (the order alternates round by round, so a noisy shared host hits both alike). Both clients stay
open, as a trainer's does (an engine is in one group at a time, hence three engines; closing a client shuts
the engine's transfer down, which frees its staging copies). After one warm-up send each. One broadcast
feeds both engines, so the bar is: 2 engines <= 1.3x one engine (median of the rounds' ratios).
The floor on this host: a raw torch.distributed Gloo broadcast of the same bytes in the same chunks to 2
receiver processes against 1 (loopback TCP on few cores copies the bytes once per receiver).

    python bench/fleet_weight_sync.py                          # SmolLM2-135M, fp32 (~5 GB of free memory)
    python bench/fleet_weight_sync.py --model FOLDER --dtype bfloat16 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

RL = '{"rl_config": {"enabled": true}}'
BAR = 1.3




def _raw_rank(rank: int, world: int, port: int, nbytes: int, chunk: int, nbuf: int, rounds: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bufs = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(nbuf)]
    times = []
    for _ in range(rounds + 1):  # the first is a warm-up
        dist.barrier()
        t, works = time.perf_counter(), []
        for k in range(-(-nbytes // chunk)):
            if len(works) >= nbuf:
                works.pop(0).wait()
            works.append(dist.broadcast(bufs[k % nbuf], 0, async_op=True))
        for w in works:
            w.wait()
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        q.put(times[1:])
    dist.destroy_process_group()


def raw_broadcast(nbytes: int, chunk: int, nbuf: int, rounds: int) -> dict[int, float]:
    """Median seconds of a raw Gloo broadcast of nbytes to 1 and to 2 receivers, alternating."""
    import torch.multiprocessing as mp

    from tests.serve_process import free_port

    ctx, out = mp.get_context("spawn"), {1: [], 2: []}
    for r in range(rounds):
        for receivers in ((1, 2) if r % 2 == 0 else (2, 1)):
            q, port = ctx.Queue(), free_port()
            procs = [ctx.Process(target=_raw_rank, args=(i, receivers + 1, port, nbytes, chunk, nbuf, 1, q))
                     for i in range(receivers + 1)]
            for p in procs:
                p.start()
            out[receivers] += q.get(timeout=600)
            for p in procs:
                p.join()
    return {n: statistics.median(ts) for n, ts in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Checkpoint folder (default: SmolLM2-135M-Instruct).")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--packed-num-buffers", type=int, default=2, help="Chunks in flight (client and engines).")
    ap.add_argument("--unpacked", action="store_true", help="One broadcast per tensor instead of packed chunks.")
    ap.add_argument("--json", help="Write the numbers to this file.")
    args = ap.parse_args()
    opts = {"packed": not args.unpacked, "packed_num_buffers": args.packed_num_buffers}
    from transformers import AutoModelForCausalLM

    folder = str(args.model or resolve_model(None, progress=True))
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    serve_args = (folder, "--additional-config", RL, "--dtype", args.dtype, "--max-model-len", "512",
                  "--kv-cache-memory-bytes", str(32 << 20), "--weight-transfer-config", '{"backend": "hccl"}')
    work = Path(tempfile.mkdtemp(prefix="rollbus-fleet-bench-"))
    for i in range(3):
        (work / f"e{i}").mkdir()
    with ThreadPoolExecutor(3) as pool:
        started = [pool.submit(start_server, work / f"e{i}", *serve_args) for i in range(3)]
    servers = [f.result() for f in started if f.exception() is None]
    clients: dict[int, WeightSyncClient] = {}
    try:
        if len(servers) < 3:
            raise next(f.exception() for f in started if f.exception() is not None)
        a, b, c = (s.url for s in servers)
        clients = {1: WeightSyncClient(a, backend="hccl", **opts), 2: WeightSyncClient([b, c], backend="hccl", **opts)}
        for n, client in clients.items():  # warm-up: the groups, staging copies, receive buffers
            client.send_weights(trainer.named_parameters(), version=f"warm-{n}")
        clients_chunk = clients[2].buffer_size
        rows = []
        for r in range(args.rounds):
            order = [1, 2] if r % 2 == 0 else [2, 1]
            t = {n: dict(clients[n].send_weights(trainer.named_parameters(), version=f"r{r}")) for n in order}
            rows.append({"one": t[1], "two": t[2], "ratio_total": t[2]["total"] / t[1]["total"],
                         "ratio_transfer": t[2]["transfer"] / t[1]["transfer"]})
            print(f"round {r}: 1 engine {t[1]['total']:.3f} s (transfer {t[1]['transfer']:.3f}), "
                  f"2 engines {t[2]['total']:.3f} s (transfer {t[2]['transfer']:.3f}), "
                  f"ratio {rows[-1]['ratio_total']:.2f}", flush=True)
    finally:
        for client in clients.values():
            client.close()
        for s in servers:
            s.stop()
    raw = raw_broadcast(nbytes, clients_chunk, args.packed_num_buffers, args.rounds)
    med = {k: statistics.median(x[k] for x in rows) for k in ("ratio_total", "ratio_transfer")}
    one = statistics.median(x["one"]["total"] for x in rows)
    two = statistics.median(x["two"]["total"] for x in rows)
    print(f"\n{folder} ({args.dtype}, {nbytes / 2**20:.0f} MiB), {args.rounds} rounds, median:\n"
          f"| engines | send_weights (s) | ratio to 1 engine |\n|---|---|---|\n| 1 | {one:.3f} | 1.00 |\n"
          f"| 2 | {two:.3f} | {med['ratio_total']:.2f} (transfer phase {med['ratio_transfer']:.2f}) |\n"
          f"Raw Gloo broadcast, same bytes and chunks: 1 receiver {raw[1]:.3f} s, 2 receivers {raw[2]:.3f} s, "
          f"ratio {raw[2] / raw[1]:.2f} (this host's floor)\n"
          f"Bar 2 engines <= {BAR}x: {'PASS' if med['ratio_total'] <= BAR else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": folder, "dtype": args.dtype, "nbytes": nbytes,
                                               "rounds": rows, "median": med, "raw_s": raw,
                                               "at": time.time()}, indent=2))


if __name__ == "__main__":
    main()
