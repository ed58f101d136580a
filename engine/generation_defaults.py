"""`--generation-config` and `--override-generation-config`: the server's default sampling parameters,
as vLLM's `ModelConfig.get_diff_sampling_param` computes them (pure; reads one JSON file).

- `auto` (default): the model folder's generation_config.json;
- `vllm`: none of the model's values, vLLM's neutral defaults (temperature 1, top_p 1, top_k 0, ...);
- a folder: that folder's generation_config.json (an error if it has none).

`--override-generation-config` (a JSON object) is applied on top in every case. Only the keys vLLM takes
count (below); max_new_tokens becomes max_tokens, the default output length of a request that sets
none (still capped by the context). A value a request sets always wins over these defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens", "skip_special_tokens")


def _read(folder: Path, required: bool) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        if required:
            raise ValueError(f"--generation-config {folder}: no generation_config.json there")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def check_generation_config(source: str) -> None:
    """Start-up check of the flags alone (the model folder is not known yet)."""
    if source not in ("auto", "vllm"):
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--generation-config must be auto, vllm or a folder; {source!r} is none of them")
        _read(folder, required=True)


def default_sampling_params(source: str, model_folder: Path, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The non-neutral default sampling parameters (vLLM's diff dict): key -> value, max_tokens for
    max_new_tokens."""
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = _read(model_folder, required=False)
    else:
        config = _read(Path(source).expanduser(), required=True)
    if override:
        config.update(override)
    out = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out
