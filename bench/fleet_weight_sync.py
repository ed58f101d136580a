"""Weight sync to a fleet (issue 33, item 5): one update to 2 engines against the same update to 1 engine.

Two `rollbus serve` engines with the collective backend (Gloo on CPU); the trainer's copy in this process.
Each round times WeightSyncClient(url_a).send_weights(...) and WeightSyncClient([url_a, url_b]).send_weights(...)
back to back (the order alternates round by round, so a noisy shared host hits both alike); forming each
group is not timed (the engine joins one group at a time, so each client forms its own before its send).
One broadcast feeds both engines, so the bar is: 2 engines <= 1.3x one engine (median of the rounds' ratios).

    python bench/fleet_weight_sync.py                          # SmolLM2-135M, fp32 (~3 GB of free memory)
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

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

RL = '{"rl_config": {"enabled": true}}'
BAR = 1.3


def send(urls: list[str], model: torch.nn.Module, version: str, other: str, **opts) -> dict[str, float]:
    with WeightSyncClient(urls if len(urls) > 1 else urls[0], backend="hccl", **opts) as client:
        client.init_transfer()  # not timed: the group
        t = dict(client.send_weights(model.named_parameters(), version=version))
    if len(urls) == 1:  # the other engine holds the same bytes (the trainer's weights do not change here):
        # give it the same label, or the fleet's next send refuses the two versions
        httpx.post(other + "/update_weight_version", json={"new_version": version}, timeout=60).raise_for_status()
    return t


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
    for i in range(2):
        (work / f"e{i}").mkdir()
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(start_server, work / f"e{i}", *serve_args) for i in range(2)]
    servers = [f.result() for f in started if f.exception() is None]
    try:
        if len(servers) < 2:
            raise next(f.exception() for f in started if f.exception() is not None)
        a, b = (s.url for s in servers)
        send([a, b], trainer, "warm-2", b, **opts)  # warm-up: staging copies, buffers, both engines on one version
        send([a], trainer, "warm-1", b, **opts)
        send([a, b], trainer, "warm-2b", b, **opts)
        rows = []
        for r in range(args.rounds):
            order = [[a], [a, b]] if r % 2 == 0 else [[a, b], [a]]
            t = {len(urls): send(urls, trainer, f"r{r}-{len(urls)}", b, **opts) for urls in order}
            rows.append({"one": t[1], "two": t[2], "ratio_total": t[2]["total"] / t[1]["total"],
                         "ratio_transfer": t[2]["transfer"] / t[1]["transfer"]})
            print(f"round {r}: 1 engine {t[1]['total']:.3f} s (transfer {t[1]['transfer']:.3f}), "
                  f"2 engines {t[2]['total']:.3f} s (transfer {t[2]['transfer']:.3f}), "
                  f"ratio {rows[-1]['ratio_total']:.2f}", flush=True)
    finally:
        for s in servers:
            s.stop()
    med = {k: statistics.median(x[k] for x in rows) for k in ("ratio_total", "ratio_transfer")}
    one = statistics.median(x["one"]["total"] for x in rows)
    two = statistics.median(x["two"]["total"] for x in rows)
    print(f"\n{folder} ({args.dtype}, {nbytes / 2**20:.0f} MiB), {args.rounds} rounds, median:\n"
          f"| engines | send_weights (s) | ratio to 1 engine |\n|---|---|---|\n| 1 | {one:.3f} | 1.00 |\n"
          f"| 2 | {two:.3f} | {med['ratio_total']:.2f} (transfer phase {med['ratio_transfer']:.2f}) |\n"
          f"Bar 2 engines <= {BAR}x: {'PASS' if med['ratio_total'] <= BAR else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": folder, "dtype": args.dtype, "nbytes": nbytes,
                                               "rounds": rows, "median": med, "at": time.time()}, indent=2))


if __name__ == "__main__":
    main()
