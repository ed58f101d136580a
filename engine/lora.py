"""LoRA adapters, the pure part: vLLM's LoRA flags, `--lora-modules` parsing, and the inspection of a PEFT
folder (adapter_config.json + adapter_model.safetensors) against the served model, without torch.

The gateway inspects an adapter before it registers it (a bad one is a 400 and nothing changes); the workers
load the tensors (workers/lora.py) from the same folder when a sequence first needs that adapter version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.argv import Switch

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# the lora_path of an adapter a trainer pushed through the weight-transfer path (no folder)
MEMORY_PREFIX = "rollbus-memory://"
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The projections an adapter may target: PEFT's module names. A mixture-of-experts model: the attention's only
# (LoRA on its experts' projections, PEFT's `target_parameters` on mlp.experts, is not implemented).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the cause."""


@dataclass(slots=True)
class LoraConfig:
    """vLLM's LoRA flags (EngineConfig.lora)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] = field(default_factory=list)
    lora_dtype: str = "auto"


def add_lora_args(p: argparse.ArgumentParser) -> None:
    d = LoraConfig()
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action=Switch, default=d.enable_lora,
                   help="Serve LoRA adapters (PEFT folders) on top of the model: a request names one as `model`. "
                        "Attention (q/k/v/o) and MLP (gate/up/down) projections; split across -tp ranks as vLLM does.")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="At most this many different adapters in one step; sequences of another adapter wait.")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="Largest adapter rank accepted; a larger one is refused (400) when it is loaded.")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="Adapter versions each worker keeps loaded (least recently used idle ones are dropped "
                        "beyond it and read again from their folder when needed). Default: --max-loras.")
    g.add_argument("--lora-modules", nargs="+", default=[],
                   help="Adapters loaded at start-up: `name=path`, or JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'.")
    g.add_argument("--lora-dtype", default=d.lora_dtype, choices=LORA_DTYPES,
                   help="dtype of the adapters' weights on the device; auto: the model's dtype.")


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: list[str]) -> list[LoraModule]:
    """vLLM's two spellings of --lora-modules: `name=path`, or a JSON object with name and path."""
    out = []
    for item in items:
        if "=" in item and "," not in item and not item.lstrip().startswith("{"):
            name, path = item.split("=", 1)
            out.append(LoraModule(name, path))
            continue
        try:
            d = json.loads(item)
            out.append(LoraModule(d["name"], d["path"], d.get("base_model_name")))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or JSON with name and path ({e})") from None
    return out


def check_lora_config(cfg: LoraConfig) -> list[str]:
    """Start-up problems of the LoRA flags (empty when none)."""
    problems = []
    if not cfg.enable_lora:
        if cfg.lora_modules:
            problems.append("--lora-modules needs --enable-lora")
        return problems
    if cfg.max_loras < 1:
        problems.append(f"--max-loras must be at least 1, got {cfg.max_loras}")
    if cfg.max_lora_rank < 1:
        problems.append(f"--max-lora-rank must be at least 1, got {cfg.max_lora_rank}")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        problems.append(f"--max-cpu-loras ({cfg.max_cpu_loras}) must be >= --max-loras ({cfg.max_loras})")
    try:
        parse_lora_modules(cfg.lora_modules)
    except ValueError as e:
        problems.append(str(e))
    return problems


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def is_moe(hf: dict[str, Any]) -> bool:
    return any(isinstance(hf.get(k), int) and hf[k] > 0 for k in MOE_KEYS)


def targets(hf: dict[str, Any]) -> tuple[str, ...]:
    """The PEFT modules an adapter of this model may target."""
    return ATTENTION if is_moe(hf) else TARGETS


def model_problem(folder: str | Path) -> str | None:
    """Why --enable-lora cannot serve this model (None: it can), from its config.json, before anything starts."""
    try:
        hf = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the workers' own load says what is wrong with the folder
    if "linear_attention" in (hf.get("layer_types") or []) or hf.get("model_type") in HYBRID_TYPES:
        return ("--enable-lora: adapters on a hybrid linear-attention model (Qwen3-Next / Qwen3.5: Gated DeltaNet "
                "layers) are not implemented; serve this model without --enable-lora")
    if hf.get("kv_lora_rank"):
        return ("--enable-lora: adapters on a model with multi-head latent attention (kv_lora_rank) are not "
                "implemented; serve this model without --enable-lora")
    return None


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


# --- a PEFT folder -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter folder holds, checked against the model: rank, scale, and every (layer, module)."""

    rank: int
    scaling: float
    modules: tuple[tuple[int, str], ...]


def module_features(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Llama/Qwen-family decoder."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    i = hf["intermediate_size"]
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 1024 * 1024:
            raise ValueError("header too large")
        return json.loads(f.read(n))


def config_rank_scaling(name: str, conf: Any, max_rank: int) -> tuple[int, float]:
    """An adapter_config.json's rank and scaling (LoraError naming the adapter for what rollbus refuses)."""
    def fail(why: str) -> LoraError:
        return LoraError(f"Loading lora {name} failed: {why}")

    if not isinstance(conf, dict):
        raise fail("adapter_config must be a JSON object")
    r = conf.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise fail(f"LoRA rank `r` must be a positive integer, got {r}.")
    if r > max_rank:
        raise fail(f"LoRA rank {r} is greater than max_lora_rank {max_rank}.")
    unsupported = [f for f, bad in (("bias", conf.get("bias", "none") != "none"), ("use_dora", conf.get("use_dora")),
                                    ("modules_to_save", conf.get("modules_to_save")),
                                    ("rank_pattern", conf.get("rank_pattern")),
                                    ("alpha_pattern", conf.get("alpha_pattern")),
                                    ("fan_in_fan_out", conf.get("fan_in_fan_out")),
                                    ("target_parameters (LoRA on the experts' projections)",
                                     conf.get("target_parameters"))) if bad]
    if unsupported:
        raise fail(f"adapter_config.json sets {', '.join(unsupported)}, which rollbus does not support")
    alpha = conf.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    return r, float(alpha / (r ** 0.5) if conf.get("use_rslora") else alpha / r)


def lora_key(key: str, hf: dict[str, Any]) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of a PEFT LoRA tensor name of a target projection of an existing layer."""
    m = _KEY.match(key)
    if m is None or m.group(3) not in targets(hf) or int(m.group(1)) >= hf["num_hidden_layers"]:
        return None
    return int(m.group(1)), m.group(3), m.group(4)


def lora_shape(rank: int, module: str, ab: str, hf: dict[str, Any]) -> list[int]:
    fin, fout = module_features(hf)[module]
    return [rank, fin] if ab == "A" else [fout, rank]


def inspect_adapter(name: str, path: str, hf: dict[str, Any], max_rank: int) -> AdapterSpec:
    """Check a PEFT folder against the model (LoraError naming `name` and the cause). FileNotFoundError for
    a folder without adapter_config.json (vLLM's 404)."""
    folder = Path(path)
    cfg_file, tensors = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise FileNotFoundError(path)

    def fail(why: str) -> LoraError:
        return LoraError(f"Loading lora {name} failed: {why}")

    try:
        conf = json.loads(cfg_file.read_text())
        header = safetensors_header(tensors)
    except (OSError, ValueError, struct.error) as e:
        raise fail(f"cannot read {cfg_file.name} / {tensors.name} in {path}: {e}") from None
    rank, scaling = config_rank_scaling(name, conf, max_rank)
    shapes = {k: list(v.get("shape", [])) for k, v in header.items() if k != "__metadata__"}
    return adapter_spec(name, rank, scaling, shapes, hf, tensors.name)


def adapter_spec(name: str, rank: int, scaling: float, shapes: dict[str, list[int]], hf: dict[str, Any],
                 source: str) -> AdapterSpec:
    """Check an adapter's tensors (PEFT names -> shapes, from a file or pushed by a trainer) against the model:
    every one a LoRA A/B of a target projection of an existing layer, of this rank and the model's features,
    A and B in pairs (LoraError naming the adapter and the cause)."""
    def fail(why: str) -> LoraError:
        return LoraError(f"Loading lora {name} failed: {why}")

    layers = hf["num_hidden_layers"]
    seen: dict[tuple[int, str], set[str]] = {}
    unexpected = []
    for key, shape in shapes.items():
        parsed = lora_key(key, hf)
        if parsed is None:
            unexpected.append(key)
            continue
        layer, mod, ab = parsed
        want = lora_shape(rank, mod, ab, hf)
        if list(shape) != want:
            raise fail(f"{key} has shape {list(shape)}, expected {want} for this model")
        seen.setdefault((layer, mod), set()).add(ab)
    if unexpected:
        moe = (" (a mixture-of-experts model: LoRA on its MLP and experts' projections is not implemented, "
               "only on the attention's)") if is_moe(hf) else ""
        raise fail(f"expected target modules in {list(targets(hf))} of layers 0..{layers - 1}{moe} but received "
                   f"{sorted(unexpected)[:8]}")
    half = [f"layer {k[0]} {k[1]}" for k, v in seen.items() if v != {"A", "B"}]
    if half:
        raise fail(f"lora_A and lora_B must come in pairs; missing one for {half[:8]}")
    if not seen:
        raise fail(f"{source} holds no LoRA weights")
    return AdapterSpec(rank, scaling, tuple(sorted(seen)))
