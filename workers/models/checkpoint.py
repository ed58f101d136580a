"""Reading an HF checkpoint folder: config.json, the dtype to run in, and the safetensors weights.

Weights are streamed one tensor at a time (safe_open) so loading never holds a second full copy of the
model in host memory, and the same iterator feeds both the first load and later weight updates.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bfloat": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def load_hf_config(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a plain dict (the model is built from it, not from transformers)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {folder}")
    with open(path) as f:
        return json.load(f)


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> torch.dtype:
    """auto -> the checkpoint's own dtype (torch_dtype / dtype key), float32 when it is absent."""
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        cfg = hf_config.get("torch_dtype") or hf_config.get("dtype")
        if cfg is None:
            return torch.float32
        cfg = str(cfg).lower().removeprefix("torch.")
        if cfg not in _DTYPES:
            raise ValueError(f"checkpoint config has unsupported dtype {cfg!r}")
        return _DTYPES[cfg]
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto|float32|bfloat16|float16|half|float|bfloat")
    return _DTYPES[name]


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, else the single file."""
    folder = Path(folder)
    index = folder / _INDEX
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / _SINGLE
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no {_SINGLE}, {_INDEX} or *.safetensors in {folder}")
    return found


def iter_checkpoint(folder: str | Path, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_safetensors, with an MXFP4 checkpoint's quantised tensors dequantised (to bf16, exactly) as they
    are read: what a model loads from a checkpoint folder (workers/models/mxfp4.py)."""
    from workers.models import mxfp4

    weights = iter_safetensors(folder, progress)
    return mxfp4.dequantized(weights) if mxfp4.is_mxfp4(load_hf_config(folder)) else weights


def iter_safetensors(folder: str | Path, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, cpu tensor) for every weight, one at a time, in file order."""
    files = safetensors_files(folder)
    bar = None
    if progress:
        from tqdm import tqdm

        total = 0
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                total += len(list(f.keys()))
        bar = tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr)
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
