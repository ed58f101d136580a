"""The decoder's configuration, read from an HF config dict: each family's flags and defaults, the checks
that refuse what is not implemented (naming the key and value), each layer's sliding window, and the
rotary tables (default, linear, llama3 and YaRN scaling; partial rotary)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ascend_ops import ops
from workers.models import mxfp4


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """The fields of an HF config dict this decoder needs, with each family's defaults applied."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm of q and k per head (Qwen3)
    qk_norm_full: bool  # ... over the whole q and k projections instead (OLMo 2, OLMoE)
    post_norms: bool  # OLMo 2: no input norm; the attention's and the MLP's outputs are normed, then added
    clip_qkv: float | None  # OLMoE: q, k, v clamped to [-clip, clip]
    windows: tuple[int, ...]  # per layer: its sliding window (keys (p - w, p] for position p), 0 = full
    rotary_dim: int  # the leading dims of each head that rope rotates (partial_rotary_factor * head_dim)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DecoderConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        qwen2, qwen3 = arch.startswith("Qwen2"), arch.startswith("Qwen3")
        olmo2, olmoe = arch.startswith("Olmo2"), arch.startswith("Olmoe")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
        _refuse_quantization(arch, cfg)
        heads = cfg["num_attention_heads"]
        # Transformers 5 nests rope settings under rope_parameters; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling and cfg.get("original_max_position_embeddings"):  # Phi-3 style: HF gives it priority
            scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        attn_bias = bool(cfg.get("attention_bias", False))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else attn_bias,
            o_bias=False if qwen2 or arch.startswith("Glm4Moe") else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qwen3,
            qk_norm_full=olmo2 or olmoe,
            post_norms=olmo2,
            clip_qkv=None if cfg.get("clip_qkv") is None else float(cfg["clip_qkv"]),
            windows=sliding_windows(arch, cfg),
            rotary_dim=int(head_dim * partial),
        )


def _refuse_quantization(arch: str, cfg: dict[str, Any]) -> None:
    """A quantised checkpoint would load as a different model: refused, naming what it declares; except
    gpt-oss's MXFP4, which the checkpoint reader dequantises (workers/models/mxfp4.py)."""
    method = mxfp4.quant_method(cfg)
    if method is not None and not mxfp4.is_mxfp4(cfg):
        only = " (unquantised checkpoints, and MXFP4 for gpt-oss, only)"
        raise NotImplementedError(f"{arch}: quantization_config quant_method {method!r} is not supported{only}")


def sliding_windows(arch: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window as HF builds its masks (0: full attention): from `layer_types` where the
    config lists them, else HF's rule for the family: every layer of a Mistral / Mixtral with
    `sliding_window` (Qwen3-MoE with `use_sliding_window`), the layers from `max_window_layers` on (Qwen2,
    Qwen3), every other layer below it (Qwen2-MoE)."""
    n = int(cfg["num_hidden_layers"])
    w = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if arch.startswith(("Qwen2", "Qwen3")) and not cfg.get("use_sliding_window"):
        w = 0
    if types:
        check_layer_types(arch, types, n, ("full_attention", "sliding_attention"))
        if "sliding_attention" in types and w <= 0:
            raise ValueError(f"{arch}: layer_types has sliding_attention layers but sliding_window is {w}")
        return tuple(w if t == "sliding_attention" else 0 for t in types)
    if arch.startswith(("Mistral", "Mixtral", "Qwen3Moe")):
        return (w,) * n
    top = int(cfg.get("max_window_layers", n))
    if arch.startswith("Qwen2Moe") and w:
        return tuple(w if (i + 1) % 2 and i < top else 0 for i in range(n))
    if arch.startswith(("Qwen2", "Qwen3")) and w:
        return tuple(w if i >= top else 0 for i in range(n))
    if w:
        raise NotImplementedError(f"{arch}: sliding_window {w} is not supported for this architecture")
    return (0,) * n


def check_layer_types(arch: str, types: list[str], n: int, allowed: tuple[str, str]) -> None:
    """`layer_types` lists one of `allowed` per layer, or the config is refused naming what is wrong."""
    if len(types) != n:
        raise ValueError(f"{arch}: layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    bad = sorted(set(types) - set(allowed))
    if bad:
        raise NotImplementedError(f"{arch}: layer_types {bad[0]!r} is not supported (only {' and '.join(allowed)})")


def _inv_freq(cfg: DecoderConfig) -> tuple[torch.Tensor | None, float]:
    """(scaled inverse frequencies, the factor cos/sin are multiplied by) for a scaled rope; (None, 1.0) for
    plain rope (ops.rope_cos_sin handles it)."""
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return None, 1.0
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if kind == "linear":  # positions divided by the factor (Gemma 3's global layers)
        return inv / sc["factor"], 1.0
    if kind == "yarn":
        return _yarn(cfg, sc)
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling / rope_parameters rope_type {kind!r} is not supported "
                                  f"(only default, linear, llama3 and yarn)")
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old_len / lo, inv / factor, inv)  # long wavelengths: fully scaled
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, mid, out), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: DecoderConfig, sc: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (as HF's _compute_yarn_parameters): the frequencies between the beta_fast and beta_slow
    corrections blend interpolated (divided by `factor`) and original ones along a linear ramp; cos/sin are
    scaled by `attention_factor` (default mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    d, base = cfg.rotary_dim, cfg.rope_theta
    old_len = sc.get("original_max_position_embeddings") or cfg.max_positions  # HF's default
    factor = sc.get("factor") or cfg.max_positions / old_len
    att = sc.get("attention_factor")
    if att is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        att = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def dim_of(rotations: float) -> float:
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(sc.get("beta_fast") or 32), dim_of(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    pos = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep, float(att)


def _rope_tables(
    cfg: DecoderConfig, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary_dim], computed once in fp32 (times YaRN's attention factor) then cast, as HF does
    per step."""
    inv, att = _inv_freq(cfg)
    if inv is None:
        return ops.rope_cos_sin(cfg.rotary_dim, n, cfg.rope_theta, device, dtype)
    freqs = torch.outer(torch.arange(n, dtype=torch.int64).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if att != 1.0:
        cos, sin = cos * att, sin * att
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
