"""Gemma3ForCausalLM (text): the dense decoder of llama.py with Gemma 3's differences.

- RMSNorm scales by (1 + weight) (its q/k norms per head too), and every layer has four norms: before and
  after attention, before and after the MLP (the "after" ones normalise the block's output before the
  residual add).
- The embedding is multiplied by sqrt(hidden_size) (rounded to the model dtype, as HF does).
- Attention scales by query_pre_attn_scalar ** -0.5; `layer_types` interleaves sliding-window layers with
  global ones, and each kind has its own rotary base (`rope_parameters["sliding_attention"]` /
  `["full_attention"]`; the global one may be linearly scaled).
- The MLP's activation is GELU (tanh approximation); `final_logit_softcapping` caps the logits with
  cap * tanh(logits / cap). `attn_logit_softcapping` is refused (Gemma 3 checkpoints leave it unset).
- Both go through the model's Kernels (`gelu_tanh_and_mul`, `tanh`): HF's expressions by default, the
  row-invariant forms of ascend_ops.invariant_activations under --batch-invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig, _rope_tables
from workers.models.llama import MLP, Attention, DecoderLM, _param, _reduce
from workers.models.tp_layout import Shard

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class Gemma3Config(DecoderConfig):
    attn_scale: float
    local_rope: DecoderConfig  # the same config with the sliding layers' rotary base and scaling
    final_softcap: float | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma3Config:
        arch = (cfg.get("architectures") or ["Gemma3ForCausalLM"])[0]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"{arch}: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(key):
                raise NotImplementedError(f"{arch}: {key} {cfg[key]!r} is not supported")
        rope = dict(cfg.get("rope_parameters") or {})
        full = rope.get("full_attention") or {"rope_type": "default", "rope_theta": 1_000_000.0}
        local = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta", "hidden_activation")}
        base = DecoderConfig.from_hf({**plain, "hidden_act": "silu", "rope_parameters": full})
        base = replace(base, qk_norm=True)
        local_base = DecoderConfig.from_hf({**plain, "hidden_act": "silu", "rope_parameters": local})
        cap = cfg.get("final_logit_softcapping")
        return cls(**{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
                   attn_scale=float(cfg.get("query_pre_attn_scalar", base.head_dim)) ** -0.5,
                   local_rope=local_base, final_softcap=None if cap is None else float(cap))


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor, routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        gu = self.kern.linear(x, self.gate_up_proj.weight)
        h = self.kern.gelu_tanh_and_mul(gu[:, : self.i], gu[:, self.i :])
        if self.tp.size == 1:
            return self.kern.linear(h, self.down_proj.weight)
        return _reduce(self.tp, self.kern.linear(h, self.down_proj.weight), None)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: Gemma3Config, mlp: nn.Module, dtype: torch.dtype, device: torch.device,
                 kern: Kernels = DEFAULT, shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__()
        self.eps, self.norm = cfg.rms_norm_eps, kern.rms_norm
        self.self_attn = Attention(cfg, dtype, device, kern, shard, tp, window)
        self.self_attn.scale, self.self_attn.norm_offset = cfg.attn_scale, 1.0
        self.mlp = mlp
        self.sliding = window > 0
        for name in _NORMS:
            setattr(self, name, nn.Module())
            getattr(self, name).weight = _param(cfg.hidden_size, dtype=dtype, device=device)

    def _n(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, getattr(self, name).weight + 1.0, self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], routed_experts: list | None = None) -> torch.Tensor:
        x = x + self._n("post_attention_layernorm", self.self_attn(self._n("input_layernorm", x), cos, sin, meta, kv))
        return x + self._n("post_feedforward_layernorm", self.mlp(self._n("pre_feedforward_layernorm", x)))


class Gemma3LM(DecoderLM):
    config_class = Gemma3Config
    layer_class = Gemma3Layer
    activation = "gelu_tanh_and_mul"
    cfg: Gemma3Config

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None, kernels: Kernels = DEFAULT, tp: Solo = SOLO) -> None:
        super().__init__(hf_config, dtype, device, max_positions, kernels, tp)
        cos, sin = _rope_tables(self.cfg.local_rope, max_positions or self.cfg.max_positions, torch.device(device),
                                dtype)
        self.register_buffer("local_cos", cos, persistent=False)
        self.register_buffer("local_sin", sin, persistent=False)
        self.embed_scale = torch.tensor(math.sqrt(self.cfg.hidden_size)).to(dtype).item()

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return GeluMLP(self.cfg, dtype, device, self.kern, self.tp)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], between_layers=None, *,
                routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = self._embed(input_ids) * self.embed_scale
        rope = {False: (self.rope_cos[positions], self.rope_sin[positions]),
                True: (self.local_cos[positions], self.local_sin[positions])}
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, *rope[layer.sliding], meta, kv, routed_experts)
            if between_layers is not None:
                between_layers()
        return self.kern.rms_norm(x, self.model.norm.weight + 1.0, self.cfg.rms_norm_eps)

    def logits_from(self, head: torch.Tensor) -> torch.Tensor:
        logits = super().logits_from(head)
        cap = self.cfg.final_softcap
        return logits if cap is None else self.kern.tanh(logits / cap) * cap
