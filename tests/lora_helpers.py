"""Test helpers for LoRA: PEFT adapters with random (non-zero) weights saved as PEFT folders, and the HF +
PEFT oracle model of one."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, *, rank: int = 4, alpha: int = 8, seed: int = 1,
                 targets: list[str] = ALL, rslora: bool = False, std: float = 0.2) -> Path:
    """A PEFT LoRA adapter for the checkpoint in `base`, every A and B random (PEFT starts B at zero)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                           use_rslora=rslora)
    model = peft.get_peft_model(hf, conf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


def peft_oracle(base: Path, adapter: Path):
    """HF transformers + PEFT, fp32, eval mode: the reference for an adapter's logprobs."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapter).eval()
