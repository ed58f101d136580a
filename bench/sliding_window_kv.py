"""The KV a long sequence of a sliding-window model holds, and its decode step time (issue 34).

1. KV held: the scheduler (engine.scheduler.policy, pure policy) runs one sequence of --tokens tokens (a
   --prompt-token prompt, then one decode per step) of a model whose every layer sees --window keys, with
   blocks of --block-size, and counts the blocks it holds at the end and at most, against the same sequence
   under full attention; bytes for the tiny Mistral shape below (SHAPE) and for Mistral-7B's KV shape (32
   layers, 8 KV heads of 128, bf16).
2. Decode step: SHAPE's model (--load-format dummy weights, random KV) decodes --seqs sequences at --tokens of
   context; ms per step (median of --steps). Where engine.block_manager has FREED (this design), the block
   tables have the blocks behind the window FREED, as the scheduler sends them; on a tree without it they are
   whole (every block held), as that scheduler sends them, so running the script on both trees compares them.

  python bench/sliding_window_kv.py --tokens 4096 --window 512 --seqs 16 --steps 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import engine.block_manager as bm_mod
from ascend_ops.attention import AttentionMetadata
from bus.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import Sequence
from engine.scheduler.policy import Scheduler
from workers.kv_cache import KVCache
from workers.loader import initialize_dummy_weights
from workers.models.registry import build_model

SHAPE = {"architectures": ["MistralForCausalLM"], "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
MISTRAL_7B = (32, 8, 128, torch.bfloat16)  # layers, KV heads, head_dim, dtype


def blocks_held(tokens: int, prompt: int, window: int, bs: int) -> tuple[int, int]:
    """(blocks held at the end, most held at once) by one sequence run to `tokens` tokens."""
    n = tokens // bs + 2
    sched = Scheduler(BlockManager(n, bs), max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=tokens + 1,
                      window=window) if "window" in Scheduler.__dataclass_fields__ else \
        Scheduler(BlockManager(n, bs), max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=tokens + 1)
    seq = Sequence("s", list(range(1, prompt + 1)), SamplingParams(max_tokens=tokens - prompt, ignore_eos=True), [0])
    sched.add(seq)
    most = held = 0
    while sched.has_work():
        step = sched.schedule()
        held = n - sched.blocks.num_free
        most = max(most, held)
        sched.update(step, {"s": (7, -0.1, None)})
    return held, most


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bs, w = args.block_size, args.window
    shape = {**SHAPE, "sliding_window": w}
    tiny = (shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"], torch.float32)
    print(f"KV one sequence holds after {args.tokens} tokens ({args.prompt}-token prompt), blocks of {bs}:")
    print("| attention | blocks at the end | most at once | tiny Mistral (fp32) | Mistral-7B shape (bf16) |")
    print("|---|---|---|---|---|")
    for name, win in (("full", 0), (f"window {w}", w)):
        end, most = blocks_held(args.tokens, args.prompt, win, bs)
        size = [KVCache.bytes_per_block(*s[:3], bs, s[3]) * end / 2**20 for s in (tiny, MISTRAL_7B)]
        print(f"| {name} | {end} | {most} | {size[0]:.1f} MiB | {size[1]:.1f} MiB |")
    model = build_model(shape, torch.float32, "cpu")
    initialize_dummy_weights(model)
    per_seq = args.tokens // bs + 1
    kv = KVCache.for_model(model, bs, args.seqs * per_seq, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    kv.tensor.copy_(torch.randn(kv.tensor.shape) * 0.1)
    ctx = args.tokens - 1
    tables = torch.arange(args.seqs * per_seq).view(args.seqs, per_seq)
    freed = hasattr(bm_mod, "FREED")
    if freed:
        tables[:, :max(0, ctx - w + 1) // bs] = bm_mod.FREED
    slots = torch.arange(args.seqs) * per_seq * bs + ctx
    meta = AttentionMetadata(slots, num_decodes=args.seqs, decode_block_tables=tables,
                             decode_ctx_lens=torch.full((args.seqs,), ctx + 1), decode_max_ctx=ctx + 1)
    ids, pos = torch.randint(0, 4096, (args.seqs,)), torch.full((args.seqs,), ctx)
    times = []
    with torch.no_grad():
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            model(ids, pos, meta, kv.views)
            times.append(time.perf_counter() - t0)
    print(f"\ndecode step, {args.seqs} sequences at {args.tokens} tokens, window {w}, {args.threads} thread(s), "
          f"fp32, tables {'with the blocks behind the window FREED' if freed else 'whole'}: "
          f"{statistics.median(times[1:]) * 1e3:.2f} ms (median of {args.steps})")


if __name__ == "__main__":
    main()
