"""How a model is split across the tp workers of one engine (Megatron-style); pure, no torch.

Per tp rank r of N: query heads [r*Hq/N, (r+1)*Hq/N); KV heads likewise when Hk >= N, else one KV head
each, head r // (N / Hk) (replicated on N / Hk ranks, vLLM's rule); the MLP's intermediate rows
[r*I/N, (r+1)*I/N) (MoE: every expert's, on its intermediate dimension; the router is replicated); the
vocabulary rows [r*Vp, (r+1)*Vp) with Vp = ceil(V / N) (the last rank's padding rows are never looked up,
and their logits are dropped). `layout_error` says, naming the value, why a layout cannot be built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _heads(hf: dict[str, Any]) -> tuple[int, int]:
    hq = int(hf["num_attention_heads"])
    return hq, int(hf.get("num_key_value_heads") or hq)


def layout_error(hf: dict[str, Any], tp: int) -> str | None:
    """Why `--tensor-parallel-size tp` cannot shard the model of HF config `hf`, or None."""
    if tp < 1:
        return f"--tensor-parallel-size must be at least 1, got {tp}"
    if tp == 1:
        return None
    arch = (hf.get("architectures") or [""])[0]
    if arch in HYBRID or hf.get("model_type") in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        for key, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
            n = int(hf.get(key) or default)
            if n % tp:
                return (f"--tensor-parallel-size {tp} does not divide the model's {n} linear-attention heads "
                        f"({key}); use a divisor of {n}")
    hq, hk = _heads(hf)
    if hq % tp:
        return (f"--tensor-parallel-size {tp} does not divide the model's {hq} attention heads "
                f"(num_attention_heads); use a divisor of {hq}")
    if hk >= tp and hk % tp:
        return (f"--tensor-parallel-size {tp} does not divide the model's {hk} KV heads (num_key_value_heads); "
                f"use a divisor of {hk}, or a multiple of it that divides {hq}")
    if hk < tp and tp % hk:
        return (f"--tensor-parallel-size {tp} is not a multiple of the model's {hk} KV heads (num_key_value_heads), "
                f"so they cannot be replicated evenly")
    if hk < tp and arch in FULL_QK_NORM:
        return (f"--tensor-parallel-size {tp} exceeds the model's {hk} KV heads (num_key_value_heads): {arch} "
                f"normalises the whole k projection, so each rank must hold distinct KV heads")
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = hf.get(key)
        if isinstance(size, int) and size % tp:
            return f"--tensor-parallel-size {tp} does not divide the model's {key} {size}"
    return None


# hybrid linear-attention models: their linear-attention heads are split too (workers/models/gated_deltanet.py)
HYBRID = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")

# QK-norm over the whole q / k projections: a rank's sum of squares is all-reduced, which needs unreplicated KV heads
FULL_QK_NORM = ("Olmo2ForCausalLM", "OlmoeForCausalLM")


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part: q heads [q0, q0 + hq), KV heads [k0, k0 + hk), vocabulary rows [v0, v0 + vp) of
    which `vocab_valid` are real tokens."""

    rank: int
    size: int
    q0: int
    hq: int
    k0: int
    hk: int
    v0: int
    vp: int
    vocab_valid: int

    def rows(self, total: int) -> tuple[int, int]:
        """(first, count) of an evenly split dimension of `total` (intermediate sizes)."""
        n = total // self.size
        return self.rank * n, n


def shard_of(num_heads: int, num_kv_heads: int, vocab_size: int, rank: int, size: int) -> Shard:
    hq = num_heads // size
    if num_kv_heads >= size:
        hk, k0 = num_kv_heads // size, rank * (num_kv_heads // size)
    else:
        hk, k0 = 1, rank // (size // num_kv_heads)
    vp = -(-vocab_size // size)
    v0 = rank * vp
    return Shard(rank, size, rank * hq, hq, k0, hk, v0, vp, max(0, min(vocab_size, v0 + vp) - v0))
