"""GptOssForCausalLM (gpt-oss-20b / 120b, dequantised to bf16 / fp32): the attention of llama.py with HF's
gpt-oss differences, and its own MoE block.

- Attention: q/k/v/o biases, `layer_types` alternating sliding-window and full layers, YaRN rope, and a
  learned sink logit per query head (`self_attn.sinks`): it joins each row's softmax denominator and
  contributes no value (ascend_ops.batch_invariant.sink_attention, in both modes: each query row computed
  alone, through the CPU row kernel where it runs, so batch-invariant as it is).
- MoE (`mlp.router`, `mlp.experts`, HF's in-memory and checkpoint layout): router logits with a bias, top-k
  of the logits, softmax over those k; experts stored transposed, gate_up_proj [E, H, 2I] with gate and up
  interleaved in its columns (gate = even, up = odd) and biases; the clamped SwiGLU
  (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit); down_proj [E, I, H]
  plus its bias. Under tp each rank holds its intermediate columns (interleaved pairs: one contiguous
  range) and rank 0 adds the down bias, so the all-reduce adds it once.
- The MXFP4 checkpoints (`quantization_config` mxfp4, as OpenAI publishes gpt-oss) are dequantised as they are
  read (workers/models/mxfp4.py); the model itself only ever holds bf16 / fp32 experts.
- Every product goes through the model's Kernels (`linear`, on `experts_nk`'s [E, out, in] of an expert's
  weight: a view by default, a cached contiguous copy under --batch-invariant; the bias added after the
  product, as HF does) and so does the activation (`clamped_swiglu`): under --batch-invariant each
  expert's GEMMs give a row the same bits whatever number of tokens chose it, and the activation is
  ascend_ops.invariant_activations' (HF's sigmoid is not row-invariant on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import DEFAULT, Kernels, sink_attention
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig
from workers.models.llama import Attention, DecoderLayer, DecoderLM, _param, _reduce
from workers.models.moe import MoEConfig, MoEDecoderLM
from workers.models.tp_layout import Shard
from workers.models.weight_map import Split, WeightMap


@dataclass(frozen=True, slots=True)
class GptOssConfig(MoEConfig):
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GptOssConfig:
        cfg = {"attention_bias": True, "rms_norm_eps": 1e-5, **cfg}
        base = DecoderConfig.from_hf(cfg)
        return cls(**{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
                   num_experts=int(cfg.get("num_local_experts", 128)), top_k=int(cfg.get("num_experts_per_tok", 4)),
                   moe_intermediate_size=base.intermediate_size, norm_topk_prob=True, fp32_expert_scale=False,
                   sparse_layers=tuple(range(base.num_layers)), shared_expert_size=0,
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


class SinkAttention(Attention):
    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__(cfg, dtype, device, kern, shard, tp, window)
        self.sinks = _param(self.hq, dtype=dtype, device=device)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        return sink_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window, self.sinks)


class SinkLayer(DecoderLayer):
    attention_class = SinkAttention


class GptOssMoE(nn.Module):
    """HF's GptOssMLP (module docstring): `router` and `experts`, this rank's intermediate part of each expert."""

    def __init__(self, cfg: GptOssConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 tp: Solo = SOLO) -> None:
        super().__init__()
        self.kern, self.tp, self.cfg = kern, tp, cfg
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size // tp.size
        kw = dict(dtype=dtype, device=device)
        self.router = nn.Module()
        self.router.weight = _param(e, h, **kw)
        self.router.bias = _param(e, **kw)
        self.experts = nn.Module()
        self.experts.transposed = True  # [E, in, out]: multiplied as kern.experts_nk's [E, out, in]
        self.experts.gate_up_proj = _param(e, h, 2 * i, **kw)
        self.experts.gate_up_proj_bias = _param(e, 2 * i, **kw)
        self.experts.down_proj = _param(e, i, h, **kw)
        self.experts.down_proj_bias = _param(e, h, **kw)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, int64 expert ids [T, k] best first)."""
        top, ids = self.kern.linear(x, self.router.weight, self.router.bias).topk(self.cfg.top_k, dim=-1)
        return torch.softmax(top, dim=1), ids

    def forward(self, x: torch.Tensor, routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        weights, ids = self.route(x)
        if routed_experts is not None:
            routed_experts.append(ids)
        y = self.local_experts(x, weights, ids)
        return y if self.tp.size == 1 else _reduce(self.tp, y, None)

    def local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of sum_k weights[:, k] * expert_{ids[:, k]}(x) [T, H], before the all-reduce (the
        start-up self-check measures it)."""
        T, k = ids.shape
        ex, kern, limit, alpha = self.experts, self.kern, self.cfg.swiglu_limit, self.cfg.swiglu_alpha
        gate_up, down = kern.experts_nk(ex.gate_up_proj), kern.experts_nk(ex.down_proj)  # [E, out, in]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert: one GEMM each
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        xs = x[order // k]
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            # as HF: product, then bias
            gu = kern.linear(xs[start:start + n], gate_up[e]) + ex.gate_up_proj_bias[e]
            d = kern.linear(kern.clamped_swiglu(gu, alpha, limit), down[e])
            out[start:start + n] = d + ex.down_proj_bias[e] if self.tp.rank == 0 else d
            start += n
        pairs = torch.empty_like(out)
        pairs[order] = out  # back to (token, slot) order: each token sums its own k products
        return (pairs.view(T, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


class GptOssLM(MoEDecoderLM):
    config_class = GptOssConfig
    layer_class = SinkLayer
    sparse_class = GptOssMoE
    activation = "clamped_swiglu"
    cfg: GptOssConfig

    def _weight_targets(self) -> WeightMap:
        """Every tensor under its HF name but q/k/v (llama.py's fused qkv); under tp, this rank's heads of the
        sinks and its intermediate part of the experts (columns of gate_up_proj and its bias: the rank's
        interleaved pairs are one range; rows of down_proj)."""
        t = DecoderLM._weight_targets(self)  # attention and embeddings (MoEDecoderLM's expert names are not these)
        sh, c = self.shard, self.cfg
        if sh.size == 1:
            return t
        full = c.intermediate_size
        i = full // sh.size
        for li in range(c.num_layers):
            a, x = f"model.layers.{li}.self_attn", f"model.layers.{li}.mlp.experts"
            t.split(f"{a}.sinks", Split(0, c.num_heads, ((sh.q0, sh.hq),)))
            t.split(f"{x}.gate_up_proj", Split(2, 2 * full, ((2 * sh.rank * i, 2 * i),)))
            t.split(f"{x}.gate_up_proj_bias", Split(1, 2 * full, ((2 * sh.rank * i, 2 * i),)))
            t.split(f"{x}.down_proj", Split(1, full, ((sh.rank * i, i),)))
        return t
