"""Architectures HF has that rollbus does not serve yet are refused at start-up naming the architecture and
why (Qwen3-Next and Qwen3.5: Gated DeltaNet layers need a recurrent-state pool), not merely 'unsupported'."""

from __future__ import annotations

import pytest
import torch

from workers.models.registry import ARCHITECTURES, REFUSED, build_model

HYBRID = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
          "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}


@pytest.mark.unit
@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_hybrid_linear_attention_families_are_refused_naming_them_and_why(arch) -> None:
    assert arch not in ARCHITECTURES
    cfg = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100}
    with pytest.raises(ValueError, match=f"unsupported architecture {arch}: .*Gated DeltaNet"):
        build_model(cfg, torch.float32, "meta")


@pytest.mark.unit
@pytest.mark.parametrize("arch, model_type", sorted(HYBRID.items()))
def test_a_config_naming_only_its_model_type_is_refused_the_same_way(arch, model_type) -> None:
    with pytest.raises(ValueError, match=f"unsupported architecture {arch}: .*state pool"):
        build_model({"model_type": model_type, "num_hidden_layers": 4}, torch.float32, "meta")
