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


def check_peft(url: str, base: Path, folder: Path, model: str, version: int, tol: float = 1e-4) -> list[float]:
    """A 5-token greedy completion of adapter `model` (fp32 server) against HF + PEFT of `folder`: every
    logprob within tol, weight_versions naming the adapter's version. Returns the logprobs."""
    import httpx

    from tests.tiny_models import random_prompt

    prompt = random_prompt(7, 1000, 5)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "return_weight_versions": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    toks, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(peft_oracle(base, folder)(torch.tensor([prompt + toks])).logits[0].float(), -1)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        assert abs(float(ref[len(prompt) - 1 + i, t]) - lp) < tol, (i, float(ref[len(prompt) - 1 + i, t]), lp)
    assert choice["weight_versions"][0]["lora_name"] == model
    assert choice["weight_versions"][0]["lora_version"] == version
    return lps
