"""A Gated DeltaNet decode step costs the same at any context length; an attention layer's grows with it.

One hybrid model (Qwen3.5's layer types at a reduced shape, SHAPE: one Gated DeltaNet layer and one gated
full-attention layer, --load-format dummy weights) decodes S sequences together at C tokens of context each.
The KV blocks and the recurrent states are filled with random values instead of prefilled (a decode's cost
does not depend on what they hold), so long contexts cost nothing to set up. Each mixer's forward is timed
on its own; the table gives ms per step and layer (median of --steps) for each context length.

  python bench/gdn_decode.py --seqs 16 --ctx 256,1024,4096 --steps 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ascend_ops.attention import AttentionMetadata
from workers.kv_cache import KVCache
from workers.loader import initialize_dummy_weights
from workers.models.registry import build_model

# Qwen3.5's linear-attention heads (16 key heads, 32 value heads, 128 dims) and attention heads (16 x 256, 2 KV
# heads, a quarter rotary) on a 2,048-wide model of two layers and a small vocabulary
SHAPE = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 4096, "hidden_size": 2048,
         "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
         "head_dim": 256, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
         "linear_conv_kernel_dim": 4, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--ctx", default="256,1024,4096", help="context lengths, comma separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ctxs = [int(c) for c in args.ctx.split(",")]
    model = build_model(SHAPE, torch.float32, "cpu")
    initialize_dummy_weights(model)
    per_seq = max(ctxs) // BLOCK + 1
    kv = KVCache.for_model(model, BLOCK, args.seqs * per_seq, torch.float32, torch.device("cpu"),
                           state_slots=args.seqs)
    torch.manual_seed(0)
    for t in (kv.tensor, kv.conv_state, kv.rec_state):
        t.copy_(torch.randn(t.shape) * 0.1)
    times: dict[str, list[float]] = {"linear": [], "attention": []}
    for layer in model.model.layers:
        mixer = layer.linear_attn if layer.linear else layer.self_attn
        kind = "linear" if layer.linear else "attention"

        def timed(*a, _f=mixer.forward, _k=kind, **kw):
            t0 = time.perf_counter()
            out = _f(*a, **kw)
            times[_k].append(time.perf_counter() - t0)
            return out

        mixer.forward = timed
    print(f"{args.seqs} sequences decoding, {args.threads} thread(s), fp32: ms per step and layer (median)")
    print("| context | Gated DeltaNet layer | attention layer |\n|---|---|---|")
    for ctx in ctxs:
        tables = torch.arange(args.seqs * per_seq).view(args.seqs, per_seq)
        meta = AttentionMetadata(tables[:, ctx // BLOCK] * BLOCK + ctx % BLOCK, num_decodes=args.seqs,
                                 decode_block_tables=tables, decode_ctx_lens=torch.full((args.seqs,), ctx + 1),
                                 decode_max_ctx=ctx + 1, state_slots=torch.arange(args.seqs))
        ids, pos = torch.randint(0, 4096, (args.seqs,)), torch.full((args.seqs,), ctx)
        for v in times.values():
            v.clear()
        for _ in range(args.steps + 1):
            model(ids, pos, meta, kv.views)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}  # the first step is a warm-up
        print(f"| {ctx} | {med['linear']:.2f} | {med['attention']:.2f} |")


if __name__ == "__main__":
    main()
