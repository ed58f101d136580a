"""Qwen3NextForCausalLM and Qwen3.5 text (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): hybrid decoders whose
layers are either Gated DeltaNet linear attention (`layer_types` "linear_attention") or gated full attention.

- Gated DeltaNet (`linear_attn`): projections to q, k, v (Hk key heads of dk, Hv value heads of dv), an output
  gate z and per-value-head b, a; a causal depthwise convolution (kernel K, silu) over [q | k | v]; q and k
  L2-normalised, q scaled by dk^-1/2; decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the
  gated delta rule over a recurrent state S [Hv, dk, dv] per sequence:
      S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
  then an RMSNorm of o per head gated by silu(z), and out_proj. Qwen3-Next packs q/k/v/z per key head in one
  `in_proj_qkvz` (and b/a in `in_proj_ba`); Qwen3.5 has `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
  Both are held under their HF names. Prefill uses the chunked form (chunks of 64 tokens), a decode the
  recurrent step; both read and write the sequence's state slot.
- Per sequence state (workers/kv_cache.py's state pool, one slot per running sequence, `meta.state_slots`):
  the last K-1 inputs of the convolution and S in fp32. A layer's cache view is (conv [slots, C, K-1],
  recurrent [slots, Hv, dk, dv]); a fresh sequence's slot is zeroed by the runner before its first chunk.
- Gated attention (`self_attn`): q_proj gives q and an output gate per head ([q_h | gate_h] for each head h),
  per-head QK-norm, rope over the leading partial_rotary_factor of each head, o * sigmoid(gate) before o_proj.
- RMSNorms scale by (1 + weight) (the gated one by weight). MoE (Qwen3-Next, Qwen3.5-MoE): softmax top-k
  renormalised, plus a shared expert gated by sigmoid(shared_expert_gate(x)).

Batch invariance (--batch-invariant, `_forward_rowwise`): every token of every sequence, decode or prefill, goes
through the same recurrent step (the chunked form's bits depend on where a chunk starts, so it is not used):
the tokens of a step's sequences are taken one position at a time, all sequences at that position together,
and a sequence's state is updated where it lies in a working copy gathered once per step. The convolution is
K multiply-adds in order per element, sigmoid, softplus and SiLU are written with exp, log1p and IEEE
divisions (torch's sigmoid / softplus / silu give an element other bits in a vector loop's scalar tail), and
the products are batched GEMMs of one shape whatever the batch (`gdn_invariant`, run by the start-up
self-check, measures it on the device). So a sequence's tokens and logprobs are the same bits alone, in any
batch, prefilled in any chunks or decoded.

Prefix caching resumes a hit from a recurrent-state checkpoint (engine/state_checkpoints.py). Tensor
parallelism splits the linear-attention heads (a key head with its value heads; gated_deltanet.tp_splits) as it
splits the attention heads, out_proj and o_proj all-reduced; a -tp that does not divide linear_num_key_heads
or linear_num_value_heads is refused naming them (tp_layout.layout_error).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.invariant_activations import sigmoid as invariant_sigmoid
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig, check_layer_types
from workers.models.gated_deltanet import GatedDeltaNet, gdn_invariant, local_heads, tp_splits
from workers.models.llama import MLP, Attention, DecoderLM, KVSpec, _param
from workers.models.moe import MoEConfig, MoEDecoderLM, SparseMoE
from workers.models.tp_layout import Shard, layout_error
from workers.models.weight_map import Split, WeightMap


class StateSpec(NamedTuple):
    """One sequence's recurrent state in every linear-attention layer (workers/kv_cache.py's state pool)."""

    num_layers: int
    conv: tuple[int, int]  # [C, K-1]: the convolution's last K-1 inputs, model dtype
    recurrent: tuple[int, int, int]  # [Hv, dk, dv], fp32


@dataclass(frozen=True, slots=True)
class HybridConfig(MoEConfig):
    linear_layers: tuple[int, ...]  # the Gated DeltaNet layers; the others are gated full attention
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    split_proj: bool  # Qwen3.5: in_proj_qkv / z / b / a (Qwen3-Next: in_proj_qkvz / ba)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> HybridConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        n = int(cfg["num_hidden_layers"])
        types = list(cfg.get("layer_types") or [])
        if not types:  # HF's default: every full_attention_interval-th layer is full attention
            every = int(cfg.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        check_layer_types(arch, types, n, ("linear_attention", "full_attention"))
        rope = dict(cfg.get("rope_parameters") or {})
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in cfg:
            rope["partial_rotary_factor"] = 0.25  # HF's default for the family
        rope.pop("mrope_section", None), rope.pop("mrope_interleaved", None)  # text positions: plain rope
        plain = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
        moe = arch.startswith(("Qwen3Next", "Qwen3_5Moe"))
        experts = int(cfg.get("num_experts") or 0) if moe else 0
        if moe:
            base = MoEConfig.from_hf({**plain, "rope_parameters": rope, "mlp_only_layers": cfg.get("mlp_only_layers"),
                                      "num_experts": experts})
        else:
            d = DecoderConfig.from_hf({**plain, "rope_parameters": rope})
            base = MoEConfig(**{f.name: getattr(d, f.name) for f in fields(DecoderConfig)}, num_experts=0, top_k=0,
                             moe_intermediate_size=0, norm_topk_prob=False, fp32_expert_scale=False,
                             sparse_layers=(), shared_expert_size=0)
        if arch.startswith("Qwen3_5Moe"):  # every layer sparse (no decoder_sparse_step / mlp_only_layers)
            base = type(base)(**{**{f.name: getattr(base, f.name) for f in fields(MoEConfig)},
                                 "sparse_layers": tuple(range(n)), "norm_topk_prob": True})
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if moe else 0
        return cls(**{**{f.name: getattr(base, f.name) for f in fields(MoEConfig)}, "shared_expert_size": shared},
                   linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                   lin_k_heads=int(cfg.get("linear_num_key_heads", 16)),
                   lin_v_heads=int(cfg.get("linear_num_value_heads", 32)),
                   lin_k_dim=int(cfg.get("linear_key_head_dim", 128)),
                   lin_v_dim=int(cfg.get("linear_value_head_dim", 128)),
                   conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                   split_proj=arch.startswith("Qwen3_5"))


class GatedAttention(Attention):
    """llama.py's attention with q_proj giving [q_h | gate_h] per head and o scaled by sigmoid(gate): the fused
    qkv_proj holds 2 * Hq * D rows of q (and gate), then k, then v."""

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__(cfg, dtype, device, kern, shard, tp, window)
        self.qkv_proj.weight = _param((2 * self.hq + 2 * self.hk) * self.d, cfg.hidden_size, dtype=dtype,
                                      device=device)
        self.norm_offset = 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, kern, d = x.shape[0], self.kern, self.d
        qg, k, v = kern.linear(x, self.qkv_proj.weight).split([2 * self.hq * d, self.hk * d, self.hk * d], dim=-1)
        q, gate = qg.view(T, self.hq, 2 * d).split([d, d], dim=-1)
        q = kern.rms_norm(q.contiguous(), self.q_norm.weight + 1.0, self.eps)
        k = kern.rms_norm(k.reshape(T, self.hk, d), self.k_norm.weight + 1.0, self.eps)
        qr, kr = kern.apply_rope(q[..., : self.rd].contiguous(), k[..., : self.rd].contiguous(), cos, sin)
        q, k = torch.cat((qr, q[..., self.rd:]), -1), torch.cat((kr, k[..., self.rd:]), -1)
        o = self._attend(q, k, v.reshape(T, self.hk, d).contiguous(), kv, meta)
        sigmoid = invariant_sigmoid if kern.batch_invariant else torch.sigmoid
        o = o.reshape(T, self.hq * d) * sigmoid(gate.reshape(T, self.hq * d))
        out = kern.linear(o, self.o_proj.weight)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


class HybridLayer(nn.Module):
    """A decoder layer whose mixer is `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention)."""

    def __init__(self, cfg: HybridConfig, mlp: nn.Module, mixer: nn.Module, linear: bool, dtype: torch.dtype,
                 device: torch.device, kern: Kernels) -> None:
        super().__init__()
        self.eps, self.norm, self.linear = cfg.rms_norm_eps, kern.rms_norm, linear
        setattr(self, "linear_attn" if linear else "self_attn", mixer)
        self.mlp = mlp
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(self, name, nn.Module())
            getattr(self, name).weight = _param(cfg.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache: tuple[torch.Tensor, torch.Tensor], routed_experts: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        n = self.norm(x, self.input_layernorm.weight + 1.0, self.eps)
        h = self.linear_attn(n, meta, cache) if self.linear else self.self_attn(n, cos, sin, meta, cache)
        x = x + h
        return x + self.mlp(self.norm(x, self.post_attention_layernorm.weight + 1.0, self.eps), routed_experts)


class HybridLM(MoEDecoderLM):
    """Qwen3-Next / Qwen3.5 causal LM. Its cache per layer (`kv_caches[i]`): attention layers' (k, v) blocks,
    linear layers' (conv, recurrent) state pool views (workers/kv_cache.py)."""

    config_class = HybridConfig
    cfg: HybridConfig

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None, kernels: Kernels = DEFAULT, tp: Solo = SOLO) -> None:
        if tp.size > 1:
            why = layout_error(hf_config, tp.size)
            if why:
                raise NotImplementedError(why)
        super().__init__(hf_config, dtype, device, max_positions, kernels, tp)

    def _make_layer(self, i: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        cfg, linear = self.cfg, i in self.cfg.linear_layers
        mixer = (GatedDeltaNet(local_heads(cfg, self.tp.size), dtype, device, self.kern, self.tp) if linear
                 else GatedAttention(cfg, dtype, device, self.kern, self.shard, self.tp))
        return HybridLayer(cfg, self._make_mlp(i, dtype, device), mixer, linear, dtype, device, self.kern)

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if layer in self.cfg.sparse_layers:
            return SparseMoE(self.cfg, dtype, device, self.kern, self.tp)
        return MLP(self.cfg, dtype, device, self.kern, self.tp)

    @property
    def kv_spec(self) -> KVSpec:
        """KV blocks for the full-attention layers only."""
        return KVSpec(self.cfg.num_layers - len(self.cfg.linear_layers), self.shard.hk, self.cfg.head_dim)

    @property
    def state_spec(self) -> StateSpec:
        """One sequence's state on this tp rank (its share of the linear-attention heads)."""
        c = local_heads(self.cfg, self.tp.size)
        conv = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
        return StateSpec(len(c.linear_layers), (conv, c.conv_kernel - 1), (c.lin_v_heads, c.lin_k_dim, c.lin_v_dim))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return self.cfg.linear_layers

    def invariance_checks(self, rand):
        """What ascend_ops.batch_invariant_check.self_check measures beyond the shared ops: one Gated DeltaNet layer
        (every one runs the same code at the same shapes)."""
        layer = self.model.layers[self.cfg.linear_layers[0]].linear_attn
        return [("gated_deltanet", lambda: gdn_invariant(layer, rand))]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], between_layers=None, *,
                routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = self._embed(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, cache, routed_experts)
            if between_layers is not None:
                between_layers()
        return self.kern.rms_norm(x, self.model.norm.weight + 1.0, self.cfg.rms_norm_eps)

    def _weight_targets(self) -> WeightMap:
        """Our own names are HF's, but q/k/v (fused qkv_proj: 2 * Hq * D rows of q_proj, q and gate per head, then
        k, then v), the dense MLPs' gate/up and the experts'; under tp, this rank's part of each (tp_splits for
        the Gated DeltaNet layers)."""
        t = WeightMap(n for n, _ in self.named_parameters())
        c, sh, d = self.cfg, self.shard, self.cfg.head_dim
        sharded = sh.size > 1
        q_full, k_full, qd, kd = 2 * c.num_heads * d, c.num_kv_heads * d, 2 * sh.hq * d, sh.hk * d
        q_part, k_part = (sh.q0 * 2 * d, qd), (sh.k0 * d, kd)
        q_split = Split(0, q_full, (q_part,)) if sharded else None
        k_split = Split(0, k_full, (k_part,)) if sharded else None
        linear = tp_splits(c, sh.rank, sh.size) if sharded else {}
        for li, layer in enumerate(self.model.layers):
            if layer.linear:
                for name, split in linear.items():
                    t.split(f"model.layers.{li}.linear_attn.{name}", split)
            else:
                a = f"model.layers.{li}.self_attn"
                t.split(f"{a}.qkv_proj.weight", sharded and Split(0, q_full + 2 * k_full, (
                    q_part, (q_full + k_part[0], kd), (q_full + k_full + k_part[0], kd))) or None)
                t.add(f"{a}.q_proj.weight", f"{a}.qkv_proj.weight", 0, qd, split=q_split)
                t.add(f"{a}.k_proj.weight", f"{a}.qkv_proj.weight", qd, kd, split=k_split)
                t.add(f"{a}.v_proj.weight", f"{a}.qkv_proj.weight", qd + kd, kd, split=k_split)
                t.split(f"{a}.o_proj.weight", sharded and Split(1, c.num_heads * d, ((sh.q0 * d, sh.hq * d),)) or None)
            if isinstance(layer.mlp, MLP):
                self._mlp_targets(t, f"model.layers.{li}.mlp", layer.mlp)
        self._expert_targets(t)
        self._vocab_targets(t)
        return t

    def skipped_weight(self, name: str) -> bool:
        """The checkpoint's multi-token-prediction head (`mtp.*`), which HF does not load either."""
        return name.startswith("mtp.")


__all__ = ["HybridLM", "StateSpec", "DecoderLM"]
