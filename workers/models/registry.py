"""Architecture name (config.json `architectures[0]`) -> model class, and the one place models are built."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from workers.models.deepseek_v3 import DeepseekV3LM
from workers.models.gemma3 import Gemma3LM
from workers.models.glm4_moe import Glm4MoeLM
from workers.models.gpt_oss import GptOssLM
from workers.models.llama import DecoderLM
from workers.models.moe import MoEDecoderLM
from workers.models.qwen3_next import HybridLM

ARCHITECTURES: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
    "Qwen3MoeForCausalLM": MoEDecoderLM,
    "MixtralForCausalLM": MoEDecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Olmo2ForCausalLM": DecoderLM,
    "Qwen2MoeForCausalLM": MoEDecoderLM,
    "OlmoeForCausalLM": MoEDecoderLM,
    "Gemma3ForCausalLM": Gemma3LM,
    "Glm4MoeForCausalLM": Glm4MoeLM,
    "DeepseekV3ForCausalLM": DeepseekV3LM,  # and Kimi-K2
    "GptOssForCausalLM": GptOssLM,
    "Qwen3NextForCausalLM": HybridLM,
    "Qwen3_5ForCausalLM": HybridLM,
    "Qwen3_5MoeForCausalLM": HybridLM,
}

# Families HF has and we do not serve yet, each refused with why (not only "unsupported").
_VISION = "its vision tower is not supported; serve the text model (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)"
REFUSED: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": f"Qwen3.5 with images: {_VISION}",
    "Qwen3_5MoeForConditionalGeneration": f"Qwen3.5-MoE with images: {_VISION}",
}

# Older or hand-made configs sometimes lack `architectures`; model_type then names the family.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "mistral": "MistralForCausalLM",
                "olmo2": "Olmo2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def architecture_of(hf_config: dict[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    if archs:
        return archs[0]
    return _MODEL_TYPES.get(hf_config.get("model_type", ""), f"<model_type {hf_config.get('model_type')!r}>")


def build_model(
    hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str, **kwargs: Any
) -> DecoderLM:
    """Instantiate (uninitialised weights) the class registered for the config's architecture."""
    arch = architecture_of(hf_config)
    cls = ARCHITECTURES.get(arch)
    if arch in REFUSED:
        raise ValueError(f"unsupported architecture {arch}: {REFUSED[arch]}")
    if cls is None:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(sorted(ARCHITECTURES))}")
    if not hf_config.get("architectures"):
        hf_config = {**hf_config, "architectures": [arch]}
    return cls(hf_config, dtype, device, **kwargs)


def shard_checksums(hf_config: dict[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]], tp: int,
                    dp_rank: int = 0) -> dict[str, str]:
    """What /weight_checker's checksum reports for an engine of tensor-parallel size `tp` holding these whole
    HF tensors: sha256 of each tp rank's part under vLLM's "dp<d>:pp0:pcp0:tp<r>:<name>" keys (a trainer's
    baseline for a bitwise, per-shard compare). The shard layouts are built on the meta device, no weights."""
    from ascend_ops.tp_group import Layout
    from engine.weights.protocol import tensor_checksum

    named = dict(named_tensors)
    out: dict[str, str] = {}
    for r in range(tp):
        layout = build_model(hf_config, torch.float32, "meta", tp=Layout(r, tp))
        prefix = f"dp{dp_rank}:pp0:pcp0:tp{r}:"
        for name in sorted(layout.checksum_names() & named.keys()):
            out[prefix + name] = tensor_checksum(layout.weight_source(name, named[name]).contiguous())
    return out
