"""The KV a long sequence of a sliding-window model holds, and its decode step time (issue 34).

1. KV held: the scheduler (engine.scheduler.policy, pure policy) runs one sequence of --tokens tokens (a
   --prompt-token prompt, then one decode per step) with blocks of --block-size, and counts the blocks each
   layer group holds at the end, against the same sequence under full attention in every layer; bytes for
   the --arch's tiny shape (its sliding layers see --window keys) and for the real model's KV shape (its own
   window): Mistral-7B (every layer windowed, with --window), Gemma 3 27B (5 sliding layers : 1 global,
   window 1024), gpt-oss-120b (alternating, window 128). Where the layers mix windows, the sliding layers have
   their own block table and pool (engine.window_blocks): only theirs is freed.
2. Decode step: the tiny shape's model (dummy weights, random KV) decodes --seqs sequences at --tokens of
   context, ms per step (median of --steps), twice: with one block table for every layer, every block held (how
   a mixed-window model ran before its layer groups), and as the scheduler sends it now (the blocks behind the
   window FREED: in the one table for Mistral, in the sliding layers' own table and pool for the mixed models).

  python bench/sliding_window_kv.py --arch gemma3 --tokens 4096 --window 512 --seqs 16 --steps 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ascend_ops.attention import AttentionMetadata
from bus.sampling_params import SamplingParams
from engine.block_manager import FREED, BlockManager
from engine.request import Sequence
from engine.scheduler.policy import Scheduler
from engine.window_blocks import WindowBlocks
from workers.kv_cache import KVCache, mixed_window
from workers.loader import initialize_dummy_weights
from workers.models.registry import build_model

BASE = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0}
S, F = "sliding_attention", "full_attention"
# arch: (tiny shape, without its window; the real model: layers' windows, KV heads, head_dim, dtype)
ARCHS = {
    "mistral": ({**BASE, "architectures": ["MistralForCausalLM"], "num_hidden_layers": 2},
                ("Mistral-7B", (-1,) * 32, 8, 128, torch.bfloat16)),  # -1: --window (its own is 4,096)
    "gemma3": ({**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
                "layer_types": [S] * 5 + [F], "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
                "rope_local_base_freq": 10000.0},
               ("Gemma 3 27B", tuple(0 if i % 6 == 5 else 1024 for i in range(62)), 16, 128, torch.bfloat16)),
    "gpt_oss": ({**BASE, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, "layer_types": [S, F],
                 "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256},
                ("gpt-oss-120b", (128, 0) * 18, 8, 64, torch.bfloat16)),
}


def blocks_held(tokens: int, prompt: int, windows: tuple[int, ...], bs: int) -> tuple[int, int]:
    """(full-attention layers' blocks, sliding layers' blocks) one sequence run to `tokens` tokens holds at
    the end: the model's layer groups (one table freed with the window where every layer has it)."""
    n = tokens // bs + 2
    w = max(windows)
    mixed = 0 in windows and w > 0
    bm = BlockManager(n, bs, windows=WindowBlocks(n, bs, w) if mixed else None)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=tokens + 1, window=w)
    seq = Sequence("s", list(range(1, prompt + 1)), SamplingParams(max_tokens=tokens - prompt, ignore_eos=True), [0])
    sched.add(seq)
    while sched.has_work():
        step = sched.schedule()
        held = (n - bm.num_free, n - bm.windows.num_free) if mixed else (n - bm.num_free,) * 2
        sched.update(step, {"s": (7, -0.1, None)})
    return held


def kv_bytes(tokens: int, prompt: int, windows: tuple[int, ...], hk: int, d: int, dtype: torch.dtype,
             bs: int) -> tuple[int, int, int]:
    """(bytes held with the layer groups, with full attention everywhere, blocks held per sliding layer)."""
    per = KVCache.bytes_per_block(1, hk, d, bs, dtype)
    full, win = blocks_held(tokens, prompt, windows, bs)
    nw = sum(1 for w in windows if w)
    everything, _ = blocks_held(tokens, prompt, (0,) * len(windows), bs)
    return per * (full * (len(windows) - nw) + win * nw), per * everything * len(windows), win


def decode_ms(model, tables_of, seqs: int, tokens: int, bs: int, steps: int) -> float:
    """Median ms of a decode step of `seqs` sequences at `tokens` of context over the KV `tables_of` builds."""
    kv, meta = tables_of(model, seqs, tokens, bs)
    ids, pos = torch.randint(0, 4096, (seqs,)), torch.full((seqs,), tokens - 1)
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            model(ids, pos, meta, kv.views)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _meta(tables: torch.Tensor, slots: torch.Tensor, tokens: int) -> AttentionMetadata:
    n = tables.shape[0]
    return AttentionMetadata(slots, num_decodes=n, decode_block_tables=tables,
                             decode_ctx_lens=torch.full((n,), tokens), decode_max_ctx=tokens)


def _random(kv: KVCache) -> None:
    for t in (kv.tensor, kv.window_tensor):
        if t is not None:
            t.copy_(torch.randn(t.shape) * 0.1)


def one_table(model, seqs: int, tokens: int, bs: int, freed: bool = False):
    """Every layer reads one table; every block held (`freed`: those behind the window FREED, Mistral now)."""
    per_seq = tokens // bs + 1
    kv = KVCache.for_model(model, bs, seqs * per_seq, torch.float32, torch.device("cpu"))
    _random(kv)
    tables = torch.arange(seqs * per_seq).view(seqs, per_seq)
    if freed:
        tables[:, :max(0, tokens - max(model.cfg.windows)) // bs] = FREED
    return kv, _meta(tables, torch.arange(seqs) * per_seq * bs + tokens - 1, tokens)


def layer_groups(model, seqs: int, tokens: int, bs: int):
    """A mixed-window model now: the full layers' table whole, the sliding layers' own table and pool holding
    only the window's blocks (FREED before it)."""
    w, _ = mixed_window(model)
    per_seq = tokens // bs + 1
    first = max(0, tokens - w) // bs  # the first block the query at position tokens - 1 sees
    kept = per_seq - first
    kv = KVCache.for_model(model, bs, seqs * per_seq, torch.float32, torch.device("cpu"), window_blocks=seqs * kept)
    _random(kv)
    slot = (tokens - 1) % bs
    meta = _meta(torch.arange(seqs * per_seq).view(seqs, per_seq),
                 torch.arange(seqs) * per_seq * bs + tokens - 1, tokens)
    wt = torch.full((seqs, per_seq), FREED)
    wt[:, first:] = torch.arange(seqs * kept).view(seqs, kept)
    meta.window_group = _meta(wt, wt[:, (tokens - 1) // bs] * bs + slot, tokens)
    return kv, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="mistral")
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
    tiny, (real_name, real_windows, real_hk, real_d, real_dtype) = ARCHS[args.arch]
    tiny = {**tiny, "sliding_window": w}
    real_windows = tuple(w if x < 0 else x for x in real_windows)
    model = build_model(tiny, torch.float32, "cpu")
    initialize_dummy_weights(model)
    mib = 2**20
    print(f"KV one sequence holds after {args.tokens} tokens ({args.prompt}-token prompt), blocks of {bs}:")
    print("| shape | layers (sliding) | window | blocks per sliding layer | KV held | full attention | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, windows, hk, d, dtype in ((f"tiny {args.arch} (fp32)", tuple(model.cfg.windows),
                                         tiny["num_key_value_heads"], tiny["head_dim"], torch.float32),
                                        (f"{real_name} ({str(real_dtype)[6:]})", real_windows, real_hk, real_d,
                                         real_dtype)):
        held, full, win = kv_bytes(args.tokens, args.prompt, windows, hk, d, dtype, bs)
        print(f"| {name} | {len(windows)} ({sum(1 for x in windows if x)}) | {max(windows)} | {win} | "
              f"{held / mib:.1f} MiB | {full / mib:.1f} MiB | {held / full:.2f} |")
    now = layer_groups if mixed_window(model)[1] else (lambda *a: one_table(*a, freed=True))
    before = decode_ms(model, one_table, args.seqs, args.tokens, bs, args.steps)
    after = decode_ms(model, now, args.seqs, args.tokens, bs, args.steps)
    print(f"\ndecode step, {args.seqs} sequences at {args.tokens} tokens, window {w}, {args.threads} thread(s), fp32 "
          f"(median of {args.steps}): one table, every block held {before:.2f} ms; blocks behind the window freed "
          f"({'their own table and pool' if now is layer_groups else 'FREED in the one table'}) "
          f"{after:.2f} ms")


if __name__ == "__main__":
    main()
