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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.argv import Switch
from engine.fleet.copy_format import read_header

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# the lora_path of an adapter a trainer pushed through the weight-transfer path (no folder)
MEMORY_PREFIX = "rollbus-memory://"
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The projections an adapter may target: PEFT's module names; on a mixture-of-experts model the MLP ones in
# its dense layers only, and its experts' stacked parameters (PEFT's `target_parameters`, below).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# LoRA on the experts: PEFT 0.21 on transformers 5 targets the stacked parameters of `mlp.experts` (a
# ParamWrapper each, nested in the module's parameter order: the first targeted one is innermost, saved under
# `experts.base_layer.lora_A`, the last under `experts.lora_A`). Per parameter A [E*r, in] (expert e's rows
# e*r..) and B [out, r*E] (expert e's columns e, e+E, ...); gate+up fused into gate_up_proj at rank 2r.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the order of transformers 5's experts module
EXPERT = "experts."  # module-name prefix of an expert parameter in AdapterSpec.modules
_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                         r"lora_([AB])\.weight$")
# the architectures whose sparse blocks are workers/models/moe.py's SparseMoE (router + stacked experts)
EXPERT_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")


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
                        "Attention (q/k/v/o) and MLP (gate/up/down) projections, and MoE experts (PEFT's "
                        "target_parameters); split across -tp ranks as vLLM does.")
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


def sparse_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """The layers of an MoE model whose MLP is the experts (workers/models/moe.py's rule), else ()."""
    if "sparse_layers" in hf:  # a worker's model_shape: from the built model
        return tuple(hf["sparse_layers"])
    if not is_moe(hf):
        return ()
    layers = hf["num_hidden_layers"]
    if (hf.get("architectures") or ["?"])[0].startswith(("Mixtral", "Olmoe")):
        return tuple(range(layers))
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def targets(hf: dict[str, Any], layer: int | None = None) -> tuple[str, ...]:
    """The PEFT modules an adapter may target in `layer` (None: in every layer) of this model."""
    sparse = sparse_layers(hf)
    if layer is None:
        return ATTENTION if sparse and len(sparse) == hf["num_hidden_layers"] else TARGETS
    return ATTENTION if layer in sparse else TARGETS


def expert_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(experts, hidden, each expert's intermediate size) of an MoE model."""
    e = next(hf[k] for k in MOE_KEYS if isinstance(hf.get(k), int) and hf[k] > 0)
    mixtral = (hf.get("architectures") or ["?"])[0].startswith(("Mixtral", "Olmoe"))
    inter = hf["intermediate_size"] if mixtral else hf.get("moe_intermediate_size", 768)
    return e, hf["hidden_size"], inter


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
class AdapterFactors:
    """What an adapter_config.json says beyond its tensors: the rank and scaling of its target_modules, and
    (expert LoRA) those of each stacked expert parameter it targets, e.g. {"gate_up_proj": (8, 2.0)}."""

    rank: int
    scaling: float
    experts: dict[str, tuple[int, float]] = field(default_factory=dict)

    def rank_of(self, module: str) -> int:
        return self.experts[module.removeprefix(EXPERT)][0] if module.startswith(EXPERT) else self.rank


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What an adapter holds, checked against the model: its factors, and every (layer, module) it targets
    (an expert parameter as "experts.gate_up_proj")."""

    factors: AdapterFactors
    modules: tuple[tuple[int, str], ...]

    @property
    def rank(self) -> int:
        return self.factors.rank

    @property
    def scaling(self) -> float:
        return self.factors.scaling


def module_features(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Llama/Qwen-family decoder (and of an MoE model's
    stacked expert parameters, per expert)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    i = hf["intermediate_size"]
    out = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
           "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if is_moe(hf):
        _, _, e_i = expert_dims(hf)
        out.update({EXPERT + "gate_up_proj": (h, 2 * e_i), EXPERT + "down_proj": (e_i, h)})
    return out


def _peft_match(pattern: str, key: str) -> bool:
    """PEFT's rank_pattern / alpha_pattern rule (peft.utils.other.get_pattern_key)."""
    return re.match(rf"(.*\.)?({pattern})$", key) is not None


def adapter_factors(name: str, conf: Any, hf: dict[str, Any], max_rank: int) -> AdapterFactors:
    """An adapter_config.json's ranks and scalings (LoraError naming the adapter for what rollbus refuses)."""
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
                                    ("fan_in_fan_out", conf.get("fan_in_fan_out"))) if bad]
    if unsupported:
        raise fail(f"adapter_config.json sets {', '.join(unsupported)}, which rollbus does not support")
    alpha = conf.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    rslora = bool(conf.get("use_rslora"))

    def scale(rank: int, a: float) -> float:
        return float(a / (rank ** 0.5) if rslora else a / rank)

    experts = expert_targets(conf.get("target_parameters"), hf, fail)
    patterns = {f: conf.get(f) or {} for f in ("rank_pattern", "alpha_pattern")}
    for field_name, pats in patterns.items():
        if not isinstance(pats, dict) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                 for v in pats.values()):
            raise fail(f"{field_name} must map patterns to numbers")
        for pat in pats:  # rollbus honours them on the experts' parameters only (PEFT's fused gate_up_proj)
            try:
                dense = [k for k in _dense_keys(hf) if _peft_match(pat, k)]
            except re.error as e:
                raise fail(f"{field_name} key {pat!r} is not a regular expression: {e}") from None
            if dense:
                raise fail(f"adapter_config.json sets {field_name} {pat!r} on {dense[0]} (a target module), which "
                           "rollbus does not support (only on the experts' target_parameters)")
    factors = {}
    for param in experts:
        keys = [f"model.layers.{layer}.mlp.experts.{param}" for layer in sparse_layers(hf)]
        found = set()
        for key in keys:
            rk = next((p for p in patterns["rank_pattern"] if _peft_match(p, key)), None)
            ak = next((p for p in patterns["alpha_pattern"] if _peft_match(p, key)), None)
            found.add((patterns["rank_pattern"][rk] if rk else r, patterns["alpha_pattern"][ak] if ak else alpha))
        if len(found) > 1:
            raise fail(f"rank_pattern / alpha_pattern give the experts' {param} different ranks in different layers, "
                       "which rollbus does not support")
        (pr, pa), = found
        fused = 2 if param == "gate_up_proj" else 1  # PEFT fuses gate and up at rank 2r
        if not isinstance(pr, int) or pr < 1 or pr > max_rank * fused:
            raise fail(f"LoRA rank {pr} of the experts' {param} is greater than max_lora_rank {max_rank}"
                       + (" times 2 (gate and up fused)" if fused == 2 else "") + " or not a positive integer.")
        factors[param] = (pr, scale(pr, pa))
    return AdapterFactors(r, scale(r, alpha), factors)


def _dense_keys(hf: dict[str, Any]) -> list[str]:
    return [f"model.layers.{layer}.{'self_attn' if m in ATTENTION else 'mlp'}.{m}"
            for layer in range(hf["num_hidden_layers"]) for m in targets(hf, layer)]


def expert_targets(entries: Any, hf: dict[str, Any], fail) -> tuple[str, ...]:
    """The stacked expert parameters a config's target_parameters names (in the experts module's order); each
    entry must name gate_up_proj or down_proj of every MoE layer's experts (PEFT's rule: the full name or a
    dot-suffix of it), anything else is refused by name."""
    if not entries:
        return ()
    if not isinstance(entries, list | tuple) or not all(isinstance(e, str) for e in entries):
        raise fail("target_parameters must be a list of parameter names")
    sparse = sparse_layers(hf)
    arch = (hf.get("architectures") or ["?"])[0]
    if not sparse or arch not in EXPERT_ARCHS:
        raise fail(f"adapter_config.json sets target_parameters {list(entries)}: LoRA on parameters is served on the "
                   f"experts of {', '.join(EXPERT_ARCHS)} only, and this model ({arch}) is not one of them")
    found = set()
    for entry in entries:
        hits = [p for p in EXPERT_PARAMS
                if all(k == entry or k.endswith("." + entry)
                       for k in (f"model.layers.{layer}.mlp.experts.{p}" for layer in sparse))]
        if not hits:
            raise fail(f"target_parameters {entry!r} is not supported: rollbus serves LoRA on the stacked expert "
                       f"parameters {'/'.join(EXPERT_PARAMS)} of every MoE layer (e.g. 'gate_up_proj' or "
                       "'mlp.experts.down_proj')")
        found.update(hits)
    return tuple(p for p in EXPERT_PARAMS if p in found)


def lora_key(key: str, hf: dict[str, Any], experts: tuple[str, ...] | dict = ()) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of a PEFT LoRA tensor name of a target projection of an existing layer, or of
    one of `experts` (the targeted expert parameters: module "experts.gate_up_proj") of an MoE layer."""
    layers = hf["num_hidden_layers"]
    m = _KEY.match(key)
    if m is not None and m.group(3) != "experts":
        layer = int(m.group(1))
        if m.group(3) not in targets(hf, layer) or layer >= layers:
            return None
        return layer, m.group(3), m.group(4)
    m = _EXPERT_KEY.match(key)
    order = [p for p in EXPERT_PARAMS if p in experts]
    if m is None or int(m.group(1)) not in sparse_layers(hf):
        return None
    depth = m.group(2).count("base_layer.")  # the last targeted parameter is the outermost wrapper
    if depth >= len(order):
        return None
    return int(m.group(1)), EXPERT + order[len(order) - 1 - depth], m.group(3)


def expert_key(layer: int, param: str, experts: tuple[str, ...] | dict, ab: str) -> str:
    """The PEFT name of expert parameter `param`'s A or B in `layer`, given every targeted one (lora_key's
    inverse: the last targeted parameter is the outermost ParamWrapper)."""
    order = [p for p in EXPERT_PARAMS if p in experts]
    depth = len(order) - 1 - order.index(param)
    return f"base_model.model.model.layers.{layer}.mlp.experts.{'base_layer.' * depth}lora_{ab}.weight"


def lora_shape(factors: AdapterFactors, module: str, ab: str, hf: dict[str, Any]) -> list[int]:
    fin, fout = module_features(hf)[module]
    rank = factors.rank_of(module)
    if module.startswith(EXPERT):
        rank *= expert_dims(hf)[0]  # every expert's A rows (B columns) stacked
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
        with open(tensors, "rb") as f:
            header, _ = read_header(f)
    except (OSError, ValueError) as e:
        raise fail(f"cannot read {cfg_file.name} / {tensors.name} in {path}: {e}") from None
    factors = adapter_factors(name, conf, hf, max_rank)
    shapes = {k: list(v.get("shape", [])) for k, v in header.items() if k != "__metadata__"}
    return adapter_spec(name, factors, shapes, hf, tensors.name)


def adapter_spec(name: str, factors: AdapterFactors, shapes: dict[str, list[int]], hf: dict[str, Any],
                 source: str) -> AdapterSpec:
    """Check an adapter's tensors (PEFT names -> shapes, from a file or pushed by a trainer) against the model:
    every one a LoRA A/B of a target projection of an existing layer (or of a targeted expert parameter), of
    its rank and the model's features, A and B in pairs (LoraError naming the adapter and the cause)."""
    def fail(why: str) -> LoraError:
        return LoraError(f"Loading lora {name} failed: {why}")

    layers = hf["num_hidden_layers"]
    seen: dict[tuple[int, str], set[str]] = {}
    unexpected = []
    for key, shape in shapes.items():
        parsed = lora_key(key, hf, factors.experts)
        if parsed is None:
            unexpected.append(key)
            continue
        layer, mod, ab = parsed
        want = lora_shape(factors, mod, ab, hf)
        if list(shape) != want:
            raise fail(f"{key} has shape {list(shape)}, expected {want} for this model")
        seen.setdefault((layer, mod), set()).add(ab)
    if unexpected:
        moe = (" (a mixture-of-experts model: MLP projections in its dense layers only; its experts through "
               "target_parameters)") if is_moe(hf) else ""
        raise fail(f"expected target modules in {list(TARGETS)} of layers 0..{layers - 1}{moe} but received "
                   f"{sorted(unexpected)[:8]}")
    return paired_spec(name, factors, seen, source)


def paired_spec(name: str, factors: AdapterFactors, seen: dict[tuple[int, str], set[str]],
                source: str) -> AdapterSpec:
    """The spec of tensors already checked one by one ((layer, module) -> the factors received, "A" and/or
    "B"): every A with its B, and at least one pair (LoraError naming the adapter)."""
    half = [f"layer {k[0]} {k[1]}" for k, v in seen.items() if v != {"A", "B"}]
    if half:
        raise LoraError(f"Loading lora {name} failed: lora_A and lora_B must come in pairs; missing one for "
                        f"{half[:8]}")
    if not seen:
        raise LoraError(f"Loading lora {name} failed: {source} holds no LoRA weights")
    return AdapterSpec(factors, tuple(sorted(seen)))
