"""A weight update into `-tp 2 -dp 2` (4 workers, 2 engines) against the same update into `-tp 1 -dp 1`, in the
same run: pause -> start -> collective transfer (Gloo on CPU) -> finish -> resume, as a trainer's
WeightSyncClient.send_weights(pause="keep") times it (client.timings, every phase but the trainer's own prepare).

The trainer sends every whole tensor once per update (a broadcast to all workers; each keeps its tp slice), so
both layouts move the same bytes from the trainer; the ratio is per byte sent all the same (bar: -tp 2 -dp 2
under 3x -tp 1 -dp 1). The model is a random Qwen3-MoE scaled up from tests/tiny_models.py's (hidden size 512:
about 70 MB fp32). Layouts alternate round by round, one server at a time (a small shared host); median of
--updates updates per round after one warm-up (the group's first update forms it).

    PYTHONPATH=$PWD python bench/scale_out.py                      # 2 rounds x 5 updates
    PYTHONPATH=$PWD python bench/scale_out.py --rounds 3 --hidden-size 256 --json out.json

The load average is printed with the table (`uptime`): on a machine busy with other work the ratio is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.trainer.client import WeightSyncClient  # noqa: E402
from tests.serve_process import free_port, start_server  # noqa: E402
from workers.models.checkpoint import iter_safetensors  # noqa: E402

RL = '{"rl_config": {"enabled": true}}'
LAYOUTS = ((1, 1), (2, 2))
PHASES = ("pause", "start", "transfer", "finish", "resume")


def make_model(folder: Path, hidden: int) -> Path:
    from engine.model_store import resolve_model
    from tests.server_helpers import tiny_model_with_tokenizer

    return tiny_model_with_tokenizer("qwen3_moe", folder, resolve_model(None, progress=False), hidden_size=hidden,
                                     intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                                     vocab_size=8000)


def run_layout(folder: Path, tp: int, dp: int, updates: int, trainer: list[list[tuple[str, torch.Tensor]]]
               ) -> list[dict[str, float]]:
    """`updates` + 1 collective updates into a fresh `-tp tp -dp dp` server; the timings of all but the first."""
    with tempfile.TemporaryDirectory(prefix=f"rollbus-tp{tp}dp{dp}-") as work:
        s = start_server(Path(work), str(folder), "-tp", str(tp), "-dp", str(dp), "--additional-config", RL,
                         "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 120}', "--max-model-len", "128",
                         "--num-gpu-blocks-override", "16", "--master-port", str(free_port()), timeout_s=600)
        try:
            out = []
            with WeightSyncClient(s.url, backend="nccl", packed=True) as c:
                for i in range(updates + 1):
                    c.send_weights(trainer[i % len(trainer)], version=f"v{i}", pause="keep")
                    if i:
                        out.append({p: c.timings.get(p, 0.0) for p in PHASES})
            return out
        finally:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollbus-scale-out-") as d:
        folder = make_model(Path(d) / "qwen3_moe", args.hidden_size)
        base = list(iter_safetensors(folder))
        g = torch.Generator().manual_seed(0)
        trainer = [[(n, t + torch.randn(t.shape, generator=g) * 0.01) for n, t in base] for _ in range(2)]
        nbytes = sum(t.numel() * t.element_size() for _, t in base)
        times: dict[tuple[int, int], list[dict[str, float]]] = {lay: [] for lay in LAYOUTS}
        for r in range(args.rounds):
            for tp, dp in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                got = run_layout(folder, tp, dp, args.updates, trainer)
                times[(tp, dp)] += got
                print(f"round {r + 1}: -tp {tp} -dp {dp}: pause->resume median "
                      f"{statistics.median(sum(t.values()) for t in got) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    load = os.getloadavg()
    rows = {}
    for (tp, dp), ts in times.items():
        total = statistics.median(sum(t.values()) for t in ts)
        rows[f"tp{tp}xdp{dp}"] = {"workers": tp * dp, "trainer_bytes": nbytes,
                                  "pause_to_resume_ms": round(total * 1e3, 1),
                                  "ms_per_MB": round(total * 1e3 / (nbytes / 1e6), 3),
                                  **{f"{p}_ms": round(statistics.median(t[p] for t in ts) * 1e3, 1) for p in PHASES}}
    one, four = rows["tp1xdp1"], rows["tp2xdp2"]
    ratio = four["ms_per_MB"] / one["ms_per_MB"]
    print(f"{'layout':10} {'workers':>7} {'MB sent':>8} {'pause->resume ms':>17} {'ms/MB':>7} "
          + " ".join(f"{p + ' ms':>11}" for p in PHASES))
    for name, row in rows.items():
        print(f"{name:10} {row['workers']:>7} {row['trainer_bytes'] / 1e6:>8.1f} {row['pause_to_resume_ms']:>17.1f} "
              f"{row['ms_per_MB']:>7.3f} " + " ".join(f"{row[p + '_ms']:>11.1f}" for p in PHASES))
    print(f"ratio tp2xdp2 / tp1xdp1 (per byte sent): {ratio:.2f} (bar: < 3); loadavg {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} on {os.cpu_count()} cpus; {args.rounds} rounds x {args.updates} updates")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": round(ratio, 3), "loadavg": load,
                                               "rounds": args.rounds, "updates": args.updates}, indent=2))


if __name__ == "__main__":
    main()
