"""Architectures HF has that rollbus does not serve are refused at start-up naming the architecture and why
(Qwen3.5 with its vision tower), not merely 'unsupported'; the hybrid text models are served, also from a
config that names only its model_type."""

from __future__ import annotations

import pytest
import torch

from workers.models.qwen3_next import HybridLM
from workers.models.registry import ARCHITECTURES, REFUSED, architecture_of, build_model

HYBRID = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
          "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}


@pytest.mark.unit
@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_vision_variants_are_refused_naming_them_and_why(arch) -> None:
    assert arch not in ARCHITECTURES
    cfg = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100}
    with pytest.raises(ValueError, match=f"unsupported architecture {arch}: .*vision tower"):
        build_model(cfg, torch.float32, "meta")


@pytest.mark.unit
@pytest.mark.parametrize("arch, model_type", sorted(HYBRID.items()))
def test_the_hybrid_text_models_are_served_also_by_model_type(arch, model_type) -> None:
    assert ARCHITECTURES[arch] is HybridLM
    assert architecture_of({"model_type": model_type}) == arch
