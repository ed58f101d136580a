"""MXFP4 checkpoints (gpt-oss as OpenAI publishes it): the experts' weights dequantised on the CPU as they
are read, so the model loads and runs in bf16 / fp32 like any other checkpoint.

The format (HF transformers' `quant_method: mxfp4`): a quantised tensor `X` of shape [E, rows, cols] is
stored as `X_blocks` (uint8 [E, rows, cols / 32, 16]: two 4-bit E2M1 codes a byte, the low nibble first)
and `X_scales` (uint8 [E, rows, cols / 32]: one power-of-two exponent per 32 values, biased by 127). A
value is FP4[code] * 2 ** (scale - 127), exact in bf16 and fp32. The checkpoint's [E, rows, cols] is the
transpose of the model's in-memory expert tensor (gate_up_proj [E, H, 2I], down_proj [E, I, H]), so
the dequantised tensor is transposed into it, as HF's `convert_moe_packed_tensors` does.
Everything else in the checkpoint (attention, router, biases, embeddings) is stored unquantised.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

# The 16 E2M1 values, indexed by their 4-bit code (sign bit 3).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ARCHITECTURES = ("GptOssForCausalLM",)  # the families whose MXFP4 checkpoints load (dequantised)
_SUFFIXES = ("_blocks", "_scales")


def quant_method(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's quantization_config quant_method (None: unquantised)."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    return str(q.get("quant_method", q)) if isinstance(q, dict) else str(q)


def is_mxfp4(cfg: dict[str, Any]) -> bool:
    """Whether this config declares an MXFP4 checkpoint of a family that loads it (dequantised)."""
    return quant_method(cfg) == "mxfp4" and (cfg.get("architectures") or [""])[0] in ARCHITECTURES


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[E, rows, G, 16] codes and [E, rows, G] exponents -> the dense [E, G * 32, rows] tensor (transposed)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(blocks [E, rows, groups, 16], scales [E, rows, groups])")
    # every byte's two values (low nibble first), and every scale byte's power of two: one lookup each
    pairs = torch.tensor(FP4_VALUES, dtype=dtype)[torch.arange(256).view(256, 1) >> torch.tensor([0, 4]) & 0x0F]
    powers = torch.exp2(torch.arange(-127, 129, dtype=torch.float64)).to(dtype)  # exact: 2**-127 .. 2**128
    e, rows, g, _ = blocks.shape
    out = torch.empty(e, g * 32, rows, dtype=dtype)
    for x in range(e):  # one expert at a time: the int64 codes of a whole tensor would be 8x its bytes
        dense = pairs.index_select(0, blocks[x].reshape(-1).long()).view(rows, g, 32)
        dense *= powers.index_select(0, scales[x].reshape(-1).long()).view(rows, g, 1)
        out[x] = dense.view(rows, g * 32).t()
    return out


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every `X_blocks` / `X_scales` pair replaced by the dense `X` (the pair
    may come in either order, in different shards); other tensors pass through. One half of a pair
    without the other is refused naming it."""
    waiting: dict[str, tuple[str, torch.Tensor]] = {}  # X -> the half read first
    for name, t in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, t
            continue
        base = name[: -len(suffix)]
        other = waiting.pop(base, None)
        if other is None:
            waiting[base] = (suffix, t)
            continue
        if other[0] == suffix:
            raise ValueError(f"MXFP4 checkpoint: tensor {name!r} appears twice")
        blocks, scales = (other[1], t) if suffix == "_scales" else (t, other[1])
        try:
            yield base, dequantize(blocks, scales, dtype)
        except ValueError as e:
            raise ValueError(f"MXFP4 checkpoint: tensor {base!r}: {e}") from None
    if waiting:
        base, (suffix, _) = next(iter(waiting.items()))
        missing = "_scales" if suffix == "_blocks" else "_blocks"
        raise ValueError(f"MXFP4 checkpoint: tensor {base + suffix!r} has no {base + missing!r}")
