"""Prefix caching on a hybrid model (Qwen3-Next / Qwen3.5): the hit rate of a repeated-prompt workload and what a
recurrent-state checkpoint costs (engine.state_checkpoints).

Workload (GRPO-like, tokens in/out): --prompts prompts, each of a shared --system tokens plus its own question,
sent in --rounds rounds of all prompts at once (the same prompts every round, as a trainer resamples them),
--max-tokens each, on the tiny Qwen3-Next of tests/tiny_models.py served with --block-size 16. Printed: prompt
tokens, prefix-cache hit tokens and their ratio (the first round can hit nothing: its prompts run together),
and the wall time per round; then the bytes of one checkpoint of the served model and of real-shape models,
against their KV bytes per block.

    python bench/hybrid_prefix.py                       # 16 prompts x 4 rounds, a 64-token system prompt
    python bench/hybrid_prefix.py --prompts 8 --rounds 2 --max-tokens 8
    python bench/hybrid_prefix.py --fresh-questions --mamba-block-size 32   # new questions each round: only the
                                                        # system prompt is shared, checkpointed every 32 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server_helpers import metric, start_server  # noqa: E402

# Qwen3-Next-80B-A3B's published shapes (48 layers, one in four full attention) and Qwen3.5-27B-like shapes
REAL = {
    "Qwen3-Next-80B-A3B": {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                           "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
}


def checkpoint_cost(shape: dict, dtype: torch.dtype, block_size: int = 16) -> tuple[int, int]:
    """(bytes of one checkpoint = one state slot, KV bytes of one block) for a hybrid config."""
    from workers.kv_cache import KVCache

    layers = shape["num_hidden_layers"]
    linear = layers - layers // shape["full_attention_interval"]
    c = 2 * shape["linear_num_key_heads"] * shape["linear_key_head_dim"] + \
        shape["linear_num_value_heads"] * shape["linear_value_head_dim"]
    from workers.models.qwen3_next import StateSpec

    spec = StateSpec(linear, (c, shape["linear_conv_kernel_dim"] - 1),
                     (shape["linear_num_value_heads"], shape["linear_key_head_dim"], shape["linear_value_head_dim"]))
    per_block = KVCache.bytes_per_block(layers - linear, shape["num_key_value_heads"], shape["head_dim"], block_size,
                                        dtype)
    return KVCache.bytes_per_state_slot(spec, dtype), per_block


async def _round(url: str, prompts: list[list[int]], max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as h:
        async def one(p: list[int]) -> None:
            r = await h.post("/inference/v1/generate", json={"token_ids": p, "sampling_params": {
                "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}})
            r.raise_for_status()
        await asyncio.gather(*[one(p) for p in prompts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system", type=int, default=64, help="tokens of the shared system prompt")
    ap.add_argument("--question", type=int, default=40, help="tokens of each prompt's own question (+ i %% 7)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--fresh-questions", action="store_true", help="other questions every round (same system prompt)")
    ap.add_argument("--mamba-block-size", type=int, default=None, help="passed to the server")
    args = ap.parse_args()
    from tests.tiny_models import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="rollbus-hybrid-prefix-"))
    folder = make_tiny_checkpoint("qwen3_next", work / "qwen3_next")
    system = [(97 * j + 13) % 990 + 5 for j in range(args.system)]
    def prompts_of(r: int) -> list[list[int]]:
        k = r if args.fresh_questions else 0
        return [system + [(31 * i + 7 * j + 3 + 101 * k) % 990 + 5 for j in range(args.question + i % 7)]
                for i in range(args.prompts)]

    extra = ("--mamba-block-size", str(args.mamba_block_size)) if args.mamba_block_size else ()
    s = start_server(work, "--model", str(folder), "--block-size", "16", "--max-model-len", "256", "--tokens-only",
                     "--max-num-seqs", str(max(8, args.prompts)), *extra, env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            asyncio.run(_round(s.url, prompts_of(r), args.max_tokens))
            print(f"round {r + 1}: {args.prompts} prompts in {time.perf_counter() - t0:.1f} s", flush=True)
        hits = metric(s, "vllm:prefix_cache_hits_total")
        info = httpx.get(s.url + "/server_info", timeout=10).json()
    finally:
        s.stop()
    total = sum(len(p) for r in range(args.rounds) for p in prompts_of(r))
    print(f"prompt tokens {total}, prefix-cache hit tokens {hits:.0f}: hit rate {hits / total:.1%} "
          f"(rounds 2-{args.rounds} alone: {hits / (total * (args.rounds - 1) / args.rounds):.1%})")
    workers = info.get("workers") or {}
    w = next(iter(workers.values()), {})
    print(f"served model: {w.get('state_checkpoints')} checkpoint slots beside {w.get('state_slots')} running state "
          f"slots and {w.get('num_blocks')} KV blocks ({w.get('kv_cache_bytes')} bytes in all)")
    for name, shape in REAL.items():
        ckpt, block = checkpoint_cost(shape, torch.bfloat16)
        print(f"{name} (bf16 conv state, fp32 recurrent state): one checkpoint {ckpt / 2**20:.1f} MiB = "
              f"{ckpt / block:.0f} KV blocks of 16 tokens ({ckpt / block * 16:.0f} tokens of KV)")


if __name__ == "__main__":
    main()
