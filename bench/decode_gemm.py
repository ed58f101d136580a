"""Decode-sized GEMMs on every fp32 packed product this CPU has (ascend_ops.packed_linear: oneDNN's, MKL's
packed sgemm, the AVX2 and AVX-512 panel kernels), against F.linear: GFLOP/s over one model's layer products (fused qkv,
o, fused gate_up, down) for every layer with distinct weights (as a decode step streams them), at the row
counts a decode step has, on 1 thread and on torch's threads. The numbers behind packed_linear's choice of
product per CPU (docs/serving.md, "Pre-packed weights").

    python bench/decode_gemm.py                         # SmolLM2-135M's shapes, rows 16 32 64 128
    python bench/decode_gemm.py --rows 8 32 85 --layers 10 --threads 1
    python bench/decode_gemm.py --dtypes fp32 bf16 --layers 10   # bf16 too, and its ratio to fp32
    python bench/decode_gemm.py --dtypes fp32 bf16 --layers 4 --threads 1 --cpu-time   # on a loaded host

bf16 (`--dtypes ... bf16`): the same weights rounded to bf16, on oneDNN's bf16 path where this CPU has a
native one, on each panel kernel (bf16 weights widened to fp32 in registers: packed_linear's bf16 product
where the CPU has no native bf16), and on F.linear twice: as torch runs it here and with oneDNN turned off
("F.linear-ref": torch's reference bf16 loop, what F.linear / HF run on a CPU without native bf16).
The last table gives each panel kernel's bf16 rate over its own fp32 rate, measured back to back.
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


def backends(dtype: torch.dtype = torch.float32) -> list[str]:
    if dtype == torch.bfloat16:
        native = packed_linear.available() is None and packed_linear.native_bf16()
        return ["onednn"] * native + [b for b in packed_linear.PANEL_WIDTHS
                                      if packed_linear.panel_unavailable(b) is None]
    out = ["onednn"] if packed_linear.available() is None else []
    out += ["mkl"] if packed_linear.mkl_unavailable() is None else []
    out += [b for b in packed_linear.PANEL_WIDTHS if packed_linear.panel_unavailable(b) is None]
    return out


def rate(weights: list[nn.Parameter], rows: int, backend: str | None, repeats: int,
         clock=time.perf_counter) -> float:
    """GFLOP/s of one pass over every weight at `rows` rows, the best of `repeats` after one warm-up pass
    (backend "F.linear-ref": F.linear with oneDNN turned off)."""
    if backend == "F.linear-ref":
        with torch.backends.mkldnn.flags(enabled=False):
            return rate(weights, rows, None, repeats, clock)
    xs = {k: torch.randn(rows, k).to(weights[0].dtype) for k in {w.shape[1] for w in weights}}
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
        t0 = clock()
        one_pass()
        best = min(best, clock() - t0)
    return flops / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Model folder with config.json (default: the default model).")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--layers", type=int, help="Layers of distinct weights (default: the model's).")
    p.add_argument("--threads", type=int, nargs="+", help="Thread counts (default: 1 and torch's).")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", help="Write the rates to this file.")
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                   help="Weight dtypes (default: fp32).")
    p.add_argument("--cpu-time", action="store_true",
                   help="Time on this thread's CPU time, not wall time (one thread only): ratios that hold on a "
                        "host other processes load.")
    args = p.parse_args()
    if args.cpu_time and args.threads != [1]:
        p.error("--cpu-time needs --threads 1 (it counts the calling thread's CPU time only)")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    folder = Path(args.model) if args.model else resolve_model(None, progress=True)
    cfg = json.loads((folder / "config.json").read_text())
    layers = args.layers or cfg["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(o, i, generator=gen) for _ in range(layers) for o, i in layer_shapes(cfg)]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    weights = {d: [nn.Parameter(w.to(dtypes[d]), requires_grad=False) for w in fp32] for d in args.dtypes}
    threads = args.threads or sorted({1, torch.get_num_threads()})
    names = {d: ["F.linear", *(["F.linear-ref"] if d == "bf16" else []), *backends(dtypes[d])] for d in args.dtypes}
    cols = [f"{d} {b}" if len(args.dtypes) > 1 else b for d in args.dtypes for b in names[d]]
    print(f"{folder.name}: {layers} layers of {layer_shapes(cfg)} (out, in), {' and '.join(args.dtypes)}, "
          f"default product here: fp32 {packed_linear.fp32_backend()}, bf16 {packed_linear.bf16_backend()}",
          flush=True)
    rows_out, ratios, results = [["threads", "rows", *cols]], [], []
    panels = [b for b in packed_linear.PANEL_WIDTHS if all(b in names[d] for d in ("fp32", "bf16") if d in names)]
    for t in threads:
        torch.set_num_threads(t)
        for m in args.rows:
            got = {f"{d} {b}": rate(weights[d], m, None if b == "F.linear" else b, args.repeats, clock)
                   for d in args.dtypes for b in names[d]}
            got = dict(zip(cols, got.values()))
            results.append({"threads": t, "rows": m, **got})
            rows_out.append([str(t), str(m), *(f"{got[k]:.1f}" for k in cols)])
            print(f"  threads {t} rows {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
            if len(args.dtypes) == 2:
                ratios.append([str(t), str(m), *(f"{got[f'bf16 {b}'] / got[f'fp32 {b}']:.2f}" for b in panels)])
    print("\nGFLOP/s over the layers' products\n" + table(rows_out))
    if ratios:
        print("\nbf16 / fp32 on each panel kernel\n" + table([["threads", "rows", *panels], *ratios]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
