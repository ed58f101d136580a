"""Mixture-of-experts decoders: Qwen3MoeForCausalLM and MixtralForCausalLM.

They are the dense decoder of llama.py (attention, rope, norms, the paged forward loop) with a sparse
feed-forward block in some or all layers. Only what differs lives here: the config fields, which layers
are sparse, the router, the stacked expert weights and the checkpoint names of their pieces.

Semantics follow HF transformers 5: router logits in the model dtype, softmax in fp32, top-k (best
first), renormalised top-k weights (always for Mixtral, with `norm_topk_prob` for Qwen3-MoE). Qwen3-MoE
casts the weights back to the model dtype before scaling the expert outputs; Mixtral scales in fp32.
Experts are stored stacked like HF's in-memory layout: `experts.gate_up_proj` [E, 2I, H] (gate rows,
then up rows) and `experts.down_proj` [E, H, I]; per-expert checkpoint tensors (what save_pretrained
writes: Qwen3-MoE `experts.N.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.N.{w1,w3,w2}`)
load into slices of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.invariant_activations import sigmoid as invariant_sigmoid
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig
from workers.models.llama import MLP, DecoderLM, _param, _reduce
from workers.models.weight_map import Split, WeightMap


@dataclass(frozen=True, slots=True)
class MoEConfig(DecoderConfig):
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    fp32_expert_scale: bool  # Mixtral scales expert outputs by fp32 weights; Qwen3-MoE casts them first
    sparse_layers: tuple[int, ...]  # indices of the MoE layers (the others are dense MLPs)
    shared_expert_size: int  # Qwen2-MoE: intermediate size of the shared expert beside the routed ones (0: none)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        mixtral = arch.startswith("Mixtral")
        olmoe = arch.startswith("Olmoe")
        if mixtral:
            # Mixtral's own defaults, where a hand-made config leaves them out.
            cfg = {"rms_norm_eps": 1e-5, **cfg}
            if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
                cfg["rope_theta"] = 1e6
        base = DecoderConfig.from_hf(cfg)
        layers = cfg["num_hidden_layers"]
        if mixtral or olmoe:
            experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 8 if mixtral else 64)))
            top_k = cfg.get("num_experts_per_tok", 2 if mixtral else 8)
            inter = base.intermediate_size  # Mixtral's and OLMoE's intermediate_size is each expert's
            sparse = tuple(range(layers))
        else:
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map alias).
            experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
            top_k, inter = cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 768)
            step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
            sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
            num_experts=experts,
            top_k=int(top_k),
            moe_intermediate_size=int(inter),
            norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
            fp32_expert_scale=mixtral,
            sparse_layers=sparse,
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch.startswith("Qwen2Moe") else 0,
        )


class SparseMoE(nn.Module):
    """Router + stacked experts, named like HF's in-memory module (`mlp.gate`, `mlp.experts`). With tensor
    parallelism the router is replicated and every expert holds this rank's intermediate rows; the experts'
    weighted sum is then one all-reduce."""

    lora_experts = None  # set by workers.lora.attach with --enable-lora

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 tp: Solo = SOLO) -> None:
        super().__init__()
        self.kern, self.tp = kern, tp
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // tp.size
        self.i = i
        self.top_k, self.renormalize, self.fp32_scale = cfg.top_k, cfg.norm_topk_prob, cfg.fp32_expert_scale
        kw = dict(dtype=dtype, device=device)
        self.gate = nn.Module()
        self.gate.weight = _param(e, h, **kw)
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param(e, 2 * i, h, **kw)
        self.experts.down_proj = _param(e, h, i, **kw)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_size:  # Qwen2-MoE: + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            self.shared_expert = MLP(cfg, dtype, device, kern, tp, cfg.shared_expert_size)
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = _param(1, h, **kw)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weights that scale each expert's output, int64 expert ids [T, k] best first)."""
        weights, ids = self.kern.moe_route(self.kern.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return (weights if self.fp32_scale else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor, routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        kern = self.kern
        weights, ids = self.route(x)
        if routed_experts is not None:
            routed_experts.append(ids)
        lora = {} if self.lora_experts is None else {"lora": self.lora_experts}  # workers/lora.py's expert_hook
        out = kern.moe_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj, **lora)
        shared = self.shared(x)
        if shared is not None:  # its partial sum joins the experts' (one reduce)
            out = out + shared
        return out if self.tp.size == 1 else _reduce(self.tp, out, None)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's partial output (Qwen2-MoE: gated by sigmoid(shared_expert_gate(x))), or None."""
        if self.shared_expert is None:
            return None
        return invariant_sigmoid(self.kern.linear(x, self.shared_expert_gate.weight)) * self.shared_expert.partial(x)


class MoEDecoderLM(DecoderLM):
    """Qwen3-MoE / Mixtral causal LM: DecoderLM with SparseMoE feed-forward blocks in cfg.sparse_layers."""

    config_class = MoEConfig
    sparse_class: type[nn.Module] = SparseMoE
    cfg: MoEConfig

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if layer in self.cfg.sparse_layers:
            return self.sparse_class(self.cfg, dtype, device, self.kern, self.tp)
        return MLP(self.cfg, dtype, device, self.kern, self.tp)

    @property
    def num_moe_layers(self) -> int:
        return len(self.cfg.sparse_layers)

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def moe_top_k(self) -> int:
        return self.cfg.top_k

    def _weight_targets(self) -> WeightMap:
        """Dense names from DecoderLM, plus every expert's pieces as slices of the stacked tensors.

        Accepted besides our own (= HF in-memory, stacked) names: Qwen3-MoE `mlp.experts.N.gate_proj.weight`
        (rows [0, I) of gate_up_proj[N]), `up_proj` (rows [I, 2I)), `down_proj` (down_proj[N]); Mixtral
        `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.N.{w1 (gate), w3 (up), w2 (down)}.weight`.
        """
        t = super()._weight_targets()
        self._expert_targets(t)
        return t

    def _expert_targets(self, t: WeightMap) -> None:
        """Every sparse layer's experts (this rank's intermediate rows under tp) and shared expert, into `t`."""
        cfg, full = self.cfg, self.cfg.moe_intermediate_size
        i = full // self.tp.size  # this rank's intermediate rows of every expert
        part = (self.shard.rank * i, i)
        sharded = self.tp.size > 1
        mixtral = cfg.architecture.startswith("Mixtral")
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for li in cfg.sparse_layers:
            m = f"model.layers.{li}.mlp"
            ckpt = f"model.layers.{li}.block_sparse_moe" if mixtral else m
            if mixtral:
                t.add(f"{ckpt}.gate.weight", f"{m}.gate.weight")
            if sharded:  # the stacked tensors under their own names: [E, 2I, H] and [E, H, I]
                t.split(f"{m}.experts.gate_up_proj", Split(1, 2 * full, (part, (full + part[0], i))))
                t.split(f"{m}.experts.down_proj", Split(2, full, (part,)))
            rows = Split(0, full, (part,)) if sharded else None
            cols = Split(1, full, (part,)) if sharded else None
            for e in range(cfg.num_experts):
                x = f"{ckpt}.experts.{e}"
                t.add(f"{x}.{gate}.weight", f"{m}.experts.gate_up_proj", 0, i, expert=e, split=rows)
                t.add(f"{x}.{up}.weight", f"{m}.experts.gate_up_proj", i, i, expert=e, split=rows)
                t.add(f"{x}.{down}.weight", f"{m}.experts.down_proj", expert=e, split=cols)
            shared = getattr(self.model.layers[li].mlp, "shared_expert", None)  # Qwen2-MoE's
            if shared is not None:
                self._mlp_targets(t, f"{m}.shared_expert", shared)
