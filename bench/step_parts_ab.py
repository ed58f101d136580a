"""Interleaved in-process A/B of decode attention and sampling at bench/step_profile.py's shapes (SmolLM2:
9 q heads, 3 kv heads, head 64, block 16; 64 decodes at ~108 tokens; 30 layers a step; vocabulary 49,152):
another checkout's ascend_ops/attention.py and its sampling (workers/sampler.py, with its workers/logits_processors.py
and workers/draw.py where it has them) against this tree's, alternating ABBA, after checking their outputs are
bitwise equal.

  git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
  python bench/step_parts_ab.py /tmp/base 1 30      # base tree, threads, repetitions
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

import ascend_ops.attention as new_att
import workers.sampler as new_s
from bus.sampling_params import SamplingParams

N, HQ, HK, D, BS, LAYERS, VOCAB = 64, 9, 3, 64, 16, 30, 49152


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# The modules the sampler was split into (since stop 46): a base checkout's sampler must run on its own copies, not
# on this tree's (its `from workers.draw import ...` would otherwise find this tree's modules in sys.modules).
SAMPLER_PARTS = ("workers.logits_processors", "workers.draw")


def load_sampler(base: str):
    """The base checkout's workers/sampler.py, its imports of SAMPLER_PARTS bound to the base's own files."""
    saved = {name: sys.modules.get(name) for name in SAMPLER_PARTS}
    try:
        for name in SAMPLER_PARTS:
            path = f"{base}/{name.replace('.', '/')}.py"
            if os.path.exists(path):
                sys.modules[name] = load(f"base_{name.rsplit('.', 1)[1]}", path)
        return load("base_s", f"{base}/workers/sampler.py")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the other checkout's root (its ascend_ops/attention.py and workers/sampler.py)")
    ap.add_argument("threads", nargs="?", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("reps", nargs="?", type=int, default=15, help="repetitions of each part (default 15)")
    args = ap.parse_args()
    base_att = load("base_att", f"{args.base}/ascend_ops/attention.py")
    base_s = load_sampler(args.base)
    torch.set_num_threads(args.threads)
    reps = args.reps
    g = torch.Generator().manual_seed(0)
    nb = N * 8 + 1
    caches = [(torch.randn(nb, BS, HK, D, generator=g), torch.randn(nb, BS, HK, D, generator=g))
              for _ in range(LAYERS)]
    tables = torch.randperm(nb - 1, generator=g)[: N * 8].view(N, 8) + 1
    lens = torch.randint(101, 109, (N,), generator=g)
    slots = tables[torch.arange(N), (lens - 1) // BS] * BS + (lens - 1) % BS
    q, k, v = torch.randn(N, HQ, D), torch.randn(N, HK, D), torch.randn(N, HK, D)
    logits = torch.randn(N, VOCAB, generator=g) * 4

    def step_attn(mod):
        meta = mod.AttentionMetadata(slots, num_decodes=N, decode_block_tables=tables, decode_ctx_lens=lens,
                                     decode_max_ctx=int(lens.max()))
        return [mod.paged_attention(q, k, v, kc, vc, meta, 0.125) for kc, vc in caches]

    def step_sample(mod):
        rows = [mod.RowState(SamplingParams(temperature=1.0, ignore_eos=True), [0], [1], [], None) for _ in range(N)]
        return mod.sample(logits, rows, torch.Generator().manual_seed(1))

    assert all(torch.equal(a, b) for a, b in zip(step_attn(base_att), step_attn(new_att)))
    assert torch.equal(step_sample(base_s).token_ids, step_sample(new_s).token_ids)
    runs = {"attn base": lambda: step_attn(base_att), "attn new": lambda: step_attn(new_att),
            "sample base": lambda: step_sample(base_s), "sample new": lambda: step_sample(new_s)}
    res: dict[str, list[float]] = {key: [] for key in runs}
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else ["attn new", "attn base", "sample new", "sample base"]  # ABBA
        for key in order:
            f = runs[key]
            t0 = time.perf_counter()
            f()
            res[key].append(time.perf_counter() - t0)
    for part in ("attn", "sample"):
        b, w = statistics.median(res[f"{part} base"]), statistics.median(res[f"{part} new"])
        ratio = statistics.median(x / y for x, y in zip(res[f"{part} new"], res[f"{part} base"]))
        print(f"{part}: base {b * 1e3:.1f} ms/step, new {w * 1e3:.1f} ms/step, paired ratio new/base {ratio:.2f}")


if __name__ == "__main__":
    main()
