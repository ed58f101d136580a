"""Build the model on a device and fill it from the checkpoint (the same in-place path weight updates
will use)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model_store import resolve_model
from workers.models.checkpoint import iter_safetensors, load_hf_config, resolve_dtype
from workers.models.registry import build_model


def load_model(cfg: EngineConfig, device: torch.device):
    folder = resolve_model(cfg.model, progress=True)
    hf_config = load_hf_config(folder)
    dtype = resolve_dtype(cfg.dtype, hf_config)
    model = build_model(hf_config, dtype, device)
    model.load_weights(iter_safetensors(folder, progress=True))
    model.eval()
    max_len = int(hf_config.get("max_position_embeddings", 2048))
    if cfg.max_model_len:
        if cfg.max_model_len > max_len:
            raise SystemExit(f"--max-model-len {cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_len}")
        max_len = cfg.max_model_len
    return model, hf_config, max_len


def reload_weights(model, cfg: EngineConfig, weights_path: str | None = None) -> set[str]:
    """Refill the existing parameters in place from the checkpoint (or another folder of the same
    architecture): the level-2 sleep recipe's `reload_weights`."""
    folder = resolve_model(weights_path or cfg.model, progress=False)
    return model.load_weights(iter_safetensors(folder))
