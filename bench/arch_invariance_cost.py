"""What --batch-invariant costs Gemma 3 and gpt-oss (issue 34): a decode step with the default kernels against
the same step on the batch-invariant ones, same weights, same KV, interleaved (A B A B ...), one process.

The step is what the worker runs for a mixed-window model: --seqs decodes at --tokens of context, the full
layers reading every block, the sliding layers their own table and pool (bench/sliding_window_kv.layer_groups),
then the LM head (and Gemma 3's soft-cap, where its config has one) for every row. Shapes (dummy weights, fp32):
- tiny: bench/sliding_window_kv.py's (hidden 512, 2-6 layers);
- small: the real models' widths on fewer layers: Gemma 3 1B (hidden 1152, MLP 6912, 4 heads / 1 KV head of
  256, vocabulary 262,144, window 512; 6 layers, 5 sliding : 1 global) and gpt-oss-20b (hidden 2880, experts'
  MLP 2880, 64 heads / 8 KV heads of 64, window 128, top-4; 2 layers, sliding then full, 8 experts of its 32
  and a vocabulary of 32,768 to fit a shared machine's memory).

  python bench/arch_invariance_cost.py --arch gemma3 --shape small --seqs 64 --tokens 512 --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's bench/

from ascend_ops.batch_invariant import DEFAULT, INVARIANT  # noqa: E402
from bench.sliding_window_kv import ARCHS, layer_groups  # noqa: E402
from workers.loader import initialize_dummy_weights  # noqa: E402
from workers.models.registry import build_model  # noqa: E402

S, F = "sliding_attention", "full_attention"
SMALL = {
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
               "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "num_hidden_layers": 6, "layer_types": [S] * 5 + [F], "sliding_window": 512,
               "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
               "max_position_embeddings": 32768, "tie_word_embeddings": True,
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "vocab_size": 32768, "hidden_size": 2880,
                "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                "num_hidden_layers": 2, "layer_types": [S, F], "sliding_window": 128, "num_local_experts": 8,
                "num_experts_per_tok": 4, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False}},
}


def models(arch: str, shape: str, window: int):
    """(default, invariant): one set of dummy weights, shared (the invariant model's parameters are views)."""
    cfg = SMALL[arch] if shape == "small" else {**ARCHS[arch][0], "sliding_window": window}
    default = build_model(cfg, torch.float32, "cpu", kernels=DEFAULT)
    initialize_dummy_weights(default)
    invariant = build_model(cfg, torch.float32, "cpu", kernels=INVARIANT)
    weights = dict(default.named_parameters())
    for name, p in invariant.named_parameters():
        p.data = weights[name].data
    return default, invariant


def step_ms(model, kv, meta, seqs: int, tokens: int) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one step: with one intra-op thread the CPU time leaves out the time
    a loaded machine kept the step waiting for a core."""
    ids, pos = torch.randint(0, model.cfg.vocab_size, (seqs,)), torch.full((seqs,), tokens - 1)
    t0, c0 = time.perf_counter(), time.thread_time()
    model.compute_logits(model(ids, pos, meta, kv.views))
    return (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(SMALL), default="gemma3")
    ap.add_argument("--shape", choices=("tiny", "small"), default="small")
    ap.add_argument("--window", type=int, default=512, help="the tiny shape's sliding window")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="A B pairs, after one warm-up step of each")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    default, invariant = models(args.arch, args.shape, args.window)
    kv, meta = layer_groups(default, args.seqs, args.tokens, args.block_size)
    times: dict[str, list[tuple[float, float]]] = {"default": [], "invariant": []}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for name, m in (("default", default), ("invariant", invariant))[:: 1 if r % 2 else -1]:
                ms = step_ms(m, kv, meta, args.seqs, args.tokens)
                if r:
                    times[name].append(ms)
    print(f"{args.arch} {args.shape}, fp32, {args.seqs} decodes at {args.tokens} tokens, {args.threads} thread(s), "
          f"median of {args.rounds} A/B rounds:")
    for k, what in enumerate(("wall", "CPU")):
        d, i = (statistics.median(t[k] for t in times[n]) for n in ("default", "invariant"))
        print(f"  {what}: default {d:.1f} ms, batch-invariant {i:.1f} ms: invariant / default {i / d:.3f}")


if __name__ == "__main__":
    main()
