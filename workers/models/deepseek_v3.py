"""DeepseekV3ForCausalLM (DeepSeek-V3 / V3.1 / R1, Kimi-K2): multi-head latent attention (MLA) over a
compressed KV cache, and GLM's MoE (glm4_moe.py: sigmoid scores with the correction bias, group-limited
top-k, routed_scaling_factor, shared experts; the first `first_k_dense_replace` layers dense; the MTP
layers of the checkpoint skipped).

MLA, as HF's DeepseekV3Attention computes it:
- q: q_b_proj(RMSNorm(q_a_proj(x))) (or q_proj(x) where q_lora_rank is null), per head qk_nope_head_dim
  dims without position then qk_rope_head_dim rotary ones;
- kv_a_proj_with_mqa(x) = [c ; k_pe]: the compressed kv c (kv_lora_rank, then RMSNorm'd) and one rotary
  key shared by every head;
- per head, k = [W_UK c ; k_pe] and v = W_UV c, with W_UK / W_UV the rows of kv_b_proj;
- softmax scale qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2, rope scaled by YaRN;
  rope_interleave: the rotary dims are taken in (even, odd) pairs, i.e. de-interleaved, then rotate-half.
Here the cache holds one row per token, [c ; k_pe] (kv_lora_rank + qk_rope_head_dim values, one plane,
workers.kv_cache), and the attention is computed absorbed, as vLLM's MLA backends compute decode steps
(here prefill too; HF, and vLLM's prefill, expand k/v per head: the same products reassociated, which
bf16 rounds at other places, docs/serving.md): a head's query
q_nope is taken into the latent space (q_nope W_UK), attends over the cached rows as one KV head
(ascend_ops.attention.latent_attention), and its latent output goes through W_UV. W_UK / W_UV are views of
kv_b_proj's weight, so a weight update of kv_b_proj changes them with it (nothing derived to refresh).
With tensor parallelism each rank holds its heads of q_b_proj, kv_b_proj and o_proj; q_a_proj and
kv_a_proj_with_mqa (the latent, the cache) are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import yarn_mscale
from workers.models.glm4_moe import Glm4MoeLM, GroupedRouterConfig
from workers.models.llama import DecoderLayer, _full_shard, _param, _reduce
from workers.models.tp_layout import Shard
from workers.models.weight_map import Split, WeightMap

# DeepseekV3Config's defaults, where a hand-made config leaves them out
_DEFAULTS = {"first_k_dense_replace": 3, "moe_intermediate_size": 2048, "routed_scaling_factor": 2.5, "n_group": 8,
             "topk_group": 4, "n_routed_experts": 256, "n_shared_experts": 1, "kv_lora_rank": 512,
             "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
             "rope_interleave": True}


@dataclass(frozen=True, slots=True)
class MLAConfig(GroupedRouterConfig):
    """num_kv_heads is 1 and head_dim kv_lora_rank + qk_rope_head_dim: the cache's one plane per layer."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MLAConfig:
        cfg = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}
        rope_dim, nope = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
        # the rotary part is qk_rope_head_dim wide, all of it turned (GLM's partial-rotary default not applied)
        base = GroupedRouterConfig.from_hf({**cfg, "head_dim": rope_dim, "partial_rotary_factor": 1.0,
                                            "num_key_value_heads": cfg["num_attention_heads"]})
        latent = int(cfg["kv_lora_rank"])
        base = replace(base, num_kv_heads=1, head_dim=latent + rope_dim, rotary_dim=rope_dim)
        scale = (nope + rope_dim) ** -0.5
        sc = base.rope_scaling or {}
        if sc.get("rope_type", sc.get("type", "default")) != "default" and sc.get("mscale_all_dim"):
            m = yarn_mscale(sc["factor"], sc["mscale_all_dim"])
            scale = scale * m * m
        return cls(**{f.name: getattr(base, f.name) for f in fields(GroupedRouterConfig)},
                   q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=latent, qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope_dim, v_head_dim=int(cfg["v_head_dim"]),
                   rope_interleave=bool(cfg["rope_interleave"]), softmax_scale=scale)


def _linear(out: int, inp: int, bias: bool, **kw: Any) -> nn.Module:
    m = nn.Module()
    m.weight = _param(out, inp, **kw)
    m.bias = _param(out, **kw) if bias else None
    return m


def _norm(n: int, **kw: Any) -> nn.Module:
    m = nn.Module()
    m.weight = _param(n, ones=True, **kw)
    return m


class MLAttention(nn.Module):
    """Multi-head latent attention over the cache's one plane (module docstring); HF's module names."""

    def __init__(self, cfg: MLAConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__()
        self.kern, self.tp = kern, tp
        self.h = (shard or _full_shard(cfg)).hq
        self.eps = cfg.rms_norm_eps
        self.latent, self.nope, self.rope, self.v = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                     cfg.v_head_dim)
        self.scale = cfg.softmax_scale
        bias = cfg.o_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        kw = dict(dtype=dtype, device=device)
        qk, hid = self.nope + self.rope, cfg.hidden_size
        self.q_lora = cfg.q_lora_rank
        if self.q_lora:
            self.q_a_proj = _linear(self.q_lora, hid, bias, **kw)
            self.q_a_layernorm = _norm(self.q_lora, **kw)
            self.q_b_proj = _linear(self.h * qk, self.q_lora, False, **kw)
        else:
            self.q_proj = _linear(self.h * qk, hid, False, **kw)
        self.kv_a_proj_with_mqa = _linear(self.latent + self.rope, hid, bias, **kw)
        self.kv_a_layernorm = _norm(self.latent, **kw)
        self.kv_b_proj = _linear(self.h * (self.nope + self.v), self.latent, False, **kw)
        self.o_proj = _linear(hid, self.h * self.v, bias, **kw)
        r = self.rope
        self.deinterleave = (torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]).to(device)
                             if cfg.rope_interleave else None)

    def head_linear_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed projections, views of kv_b_proj in head_linear's [heads, out, in] layout: W_UK^T (q_nope
        into the latent space) and W_UV (a latent output into the value dims)."""
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.latent)
        return w[:, : self.nope].transpose(1, 2), w[:, self.nope:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, kern = x.shape[0], self.kern
        if self.q_lora:
            qa = kern.linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
            q = kern.linear(kern.rms_norm(qa, self.q_a_layernorm.weight, self.eps), self.q_b_proj.weight)
        else:
            q = kern.linear(x, self.q_proj.weight)
        q = q.view(T, self.h, self.nope + self.rope)
        ckv = kern.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)  # [T, latent + rope]
        c = kern.rms_norm(ckv[:, : self.latent].contiguous(), self.kv_a_layernorm.weight, self.eps)
        q_pe, k_pe = q[..., self.nope:], ckv[:, self.latent:].view(T, 1, self.rope)
        if self.deinterleave is not None:
            q_pe, k_pe = q_pe[..., self.deinterleave], k_pe[..., self.deinterleave]
        q_pe, k_pe = kern.apply_rope(q_pe.contiguous(), k_pe.contiguous(), cos, sin)
        w_uk, w_uv = self.head_linear_weights()
        q_lat = kern.head_linear(q[..., : self.nope], w_uk)  # [T, h, latent]
        latent = torch.cat((c, k_pe.view(T, self.rope)), dim=-1).view(T, 1, -1)
        o = kern.latent_attention(torch.cat((q_lat, q_pe), dim=-1), latent, kv[0], meta, self.scale, self.latent)
        o = kern.head_linear(o, w_uv).reshape(T, self.h * self.v)  # [T, h * v]
        if self.tp.size == 1:
            return kern.linear(o, self.o_proj.weight, self.o_proj.bias)
        return _reduce(self.tp, kern.linear(o, self.o_proj.weight), self.o_proj.bias)


class MLALayer(DecoderLayer):
    attention_class = MLAttention


class DeepseekV3LM(Glm4MoeLM):
    config_class = MLAConfig
    layer_class = MLALayer
    cfg: MLAConfig

    @property
    def kv_planes(self) -> int:
        """One plane: each token's [compressed kv ; rotary key] (kv_spec: 1 head of kv_lora + rope dims)."""
        return 1

    def _attention_targets(self, t: WeightMap, a: str) -> None:
        """Every tensor under its HF name; under tp this rank's heads of q_b_proj (q_proj), kv_b_proj (rows)
        and o_proj (columns); the rest replicated."""
        sh, c = self.shard, self.cfg
        if sh.size == 1:
            return
        heads = c.num_heads
        for name, per in (("q_b_proj" if c.q_lora_rank else "q_proj", c.qk_nope_head_dim + c.qk_rope_head_dim),
                          ("kv_b_proj", c.qk_nope_head_dim + c.v_head_dim)):
            t.split(f"{a}.{name}.weight", Split(0, heads * per, ((sh.q0 * per, sh.hq * per),)))
        t.split(f"{a}.o_proj.weight", Split(1, heads * c.v_head_dim, ((sh.q0 * c.v_head_dim, sh.hq * c.v_head_dim),)))
