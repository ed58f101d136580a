"""Decode-sized GEMMs on every fp32 packed product this CPU has (ascend_ops.packed_linear: oneDNN's, MKL's
packed sgemm, the AVX2 and AVX-512 panel kernels), against F.linear: GFLOP/s over one model's layer products (fused qkv,
o, fused gate_up, down) for every layer with distinct weights (as a decode step streams them), at the row
counts a decode step has, on 1 thread and on torch's threads. The numbers behind packed_linear's choice of
product per CPU (docs/serving.md, "Pre-packed weights").

    python bench/decode_gemm.py                         # SmolLM2-135M's shapes, rows 16 32 64 128
    python bench/decode_gemm.py --rows 8 32 85 --layers 10 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_ops import packed_linear  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402


def layer_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's products, q/k/v and gate/up fused as the model runs them."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads)
    inter = cfg["intermediate_size"]
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]


def backends() -> list[str]:
    out = ["onednn"] if packed_linear.available() is None else []
    out += ["mkl"] if packed_linear.mkl_unavailable() is None else []
    out += [b for b in packed_linear.PANEL_WIDTHS if packed_linear.panel_unavailable(b) is None]
    return out


def rate(weights: list[nn.Parameter], rows: int, backend: str | None, repeats: int) -> float:
    """GFLOP/s of one pass over every weight at `rows` rows, the best of `repeats` after one warm-up pass."""
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    flops = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in weights)

    def one_pass() -> None:
        for w in weights:
            if backend is None:
                F.linear(xs[w.shape[1]], w)
            else:
                packed_linear.product(xs[w.shape[1]], w, None, backend=backend)

    one_pass()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Model folder with config.json (default: the default model).")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--layers", type=int, help="Layers of distinct weights (default: the model's).")
    p.add_argument("--threads", type=int, nargs="+", help="Thread counts (default: 1 and torch's).")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", help="Write the rates to this file.")
    args = p.parse_args()
    folder = Path(args.model) if args.model else resolve_model(None, progress=True)
    cfg = json.loads((folder / "config.json").read_text())
    layers = args.layers or cfg["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(o, i, generator=gen), requires_grad=False)
               for _ in range(layers) for o, i in layer_shapes(cfg)]
    threads = args.threads or sorted({1, torch.get_num_threads()})
    names = backends()
    print(f"{folder.name}: {layers} layers of {layer_shapes(cfg)} (out, in), fp32, "
          f"default product here: {packed_linear.fp32_backend()}", flush=True)
    rows_out, results = [["threads", "rows", "F.linear", *names]], []
    for t in threads:
        torch.set_num_threads(t)
        for m in args.rows:
            got = {"F.linear": rate(weights, m, None, args.repeats)}
            got |= {b: rate(weights, m, b, args.repeats) for b in names}
            results.append({"threads": t, "rows": m, **got})
            rows_out.append([str(t), str(m), *(f"{got[k]:.1f}" for k in ["F.linear", *names])])
            print(f"  threads {t} rows {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    widths = [max(len(r[i]) for r in rows_out) for i in range(len(rows_out[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows_out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    print("\nGFLOP/s over the layers' products\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
