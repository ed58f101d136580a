"""Build the model on a device and fill it from the checkpoint (the same in-place path weight updates
will use)."""

from __future__ import annotations

import torch

from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.tp_group import SOLO, Solo
from engine.config import EngineConfig
from engine.model_store import resolve_model
from workers.models.checkpoint import iter_checkpoint, load_hf_config, resolve_dtype
from workers.models.registry import build_model
from workers.models.tp_layout import layout_error

DUMMY_RANGE = 1e-3  # vLLM's dummy loader: floating-point weights uniform in [-1e-3, 1e-3]
DUMMY_SEED = 1234  # ... each tensor from a fresh generator with this seed (so runs and ranks agree)


def initialize_dummy_weights(model: torch.nn.Module) -> int:
    """`--load-format dummy`, as vLLM: every parameter and persistent buffer of a floating dtype filled
    uniformly in [-1e-3, 1e-3] from a generator seeded 1234 per tensor (identical on every worker and run);
    8-bit integers random bytes; other integer tensors and non-persistent buffers (RoPE tables) untouched.
    Returns how many tensors were filled."""
    filled = 0
    for module in model.modules():
        tensors = [*module.named_parameters(recurse=False),
                   *((n, b) for n, b in module.named_buffers(recurse=False)
                     if n not in module._non_persistent_buffers_set)]
        for _, t in tensors:
            gen = torch.Generator(device=t.device)
            gen.manual_seed(DUMMY_SEED)
            with torch.no_grad():
                if t.dtype == torch.int8:
                    t.random_(-128, 128, generator=gen)
                elif t.dtype == torch.uint8:
                    t.random_(0, 256, generator=gen)
                elif not torch.is_floating_point(t):
                    continue
                elif torch.finfo(t.dtype).bits < 16:  # uniform_ has no 8-bit float kernels
                    t.copy_(torch.empty_like(t, dtype=torch.float16).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))
                else:
                    t.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
            filled += 1
    return filled


def load_model(cfg: EngineConfig, device: torch.device, kernels: Kernels = DEFAULT, tp: Solo = SOLO):
    """The model on `device`; with a tp group, this rank's shard of it (each checkpoint tensor is read
    whole and sliced)."""
    folder = resolve_model(cfg.model.model, progress=cfg.model.use_tqdm_on_load)
    hf_config = load_hf_config(folder)
    why = layout_error(hf_config, tp.size)
    if why:
        raise SystemExit(f"rollbus: {why}")
    dtype = resolve_dtype(cfg.model.dtype, hf_config)
    try:
        model = build_model(hf_config, dtype, device, kernels=kernels, tp=tp)
    except (ValueError, NotImplementedError) as e:  # an architecture or config value not served: named in e
        raise SystemExit(f"rollbus: {folder}: {e}") from None
    if cfg.model.load_format == "dummy":  # no checkpoint is read: the trainer's first weight sync fills it
        initialize_dummy_weights(model)
    else:
        try:
            loaded = model.load_weights(iter_checkpoint(folder, progress=cfg.model.use_tqdm_on_load))
        except (KeyError, ValueError) as e:  # an extra tensor, or one of the wrong shape: named in the message
            raise SystemExit(f"rollbus: checkpoint {folder}: {e.args[0] if e.args else e}") from None
        missing = model.missing_weights(loaded)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise SystemExit(f"rollbus: checkpoint {folder} lacks tensor {', '.join(missing[:3])}{more}")
    model.eval()
    max_len = int(hf_config.get("max_position_embeddings", 2048))
    if cfg.model.max_model_len:
        if cfg.model.max_model_len > max_len:
            raise SystemExit(f"--max-model-len {cfg.model.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_len}")
        max_len = cfg.model.max_model_len
    return model, hf_config, max_len


def reload_weights(model, cfg: EngineConfig, weights_path: str | None = None) -> set[str]:
    """Refill the existing parameters in place from the checkpoint (or another folder of the same
    architecture): the level-2 sleep recipe's `reload_weights`."""
    try:
        folder = resolve_model(weights_path or cfg.model.model, progress=False)
    except (FileNotFoundError, ValueError) as e:  # the caller's path: a 400 naming it, not a worker failure
        from engine.weights.protocol import WeightSyncError

        raise WeightSyncError(f"weights_path: {e}", status=400, param="kwargs.weights_path") from None
    return model.load_weights(iter_checkpoint(folder))
