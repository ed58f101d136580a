"""Glm4MoeForCausalLM (GLM-4.5 / 4.6): the MoE decoder of moe.py with GLM's router and shared experts.

- Attention: q/k/v bias (no o bias), optional per-head QK-norm (`use_qk_norm`), rope over the leading
  `partial_rotary_factor` (default 0.5) of each head (llama.py's rotary_dim).
- The first `first_k_dense_replace` layers are dense MLPs; the others route each token to top-k of
  `n_routed_experts` and add `n_shared_experts` always-on experts (one MLP of n_shared * moe_intermediate_size).
- The router (HF's Glm4MoeTopkRouter, DeepSeek-V3's `noaux_tc`): fp32 logits, sigmoid scores; the choice adds
  `e_score_correction_bias` and is limited to the `topk_group` best of `n_group` expert groups (a group
  scores the sum of its two best); the weights are the unbiased scores of the chosen experts, renormalised
  (`norm_topk_prob`) and scaled by `routed_scaling_factor`, in fp32.
- The checkpoint's MTP layers (`model.layers.<num_hidden_layers + i>.*`, `num_nextn_predict_layers` of them)
  are skipped, as HF skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.invariant_activations import sigmoid as invariant_sigmoid
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig
from workers.models.llama import MLP, _param
from workers.models.moe import MoEConfig, MoEDecoderLM, SparseMoE
from workers.models.weight_map import WeightMap


@dataclass(frozen=True, slots=True)
class GroupedRouterConfig(MoEConfig):
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    mtp_layers: int  # checkpoint layers after the last decoder layer that are not loaded

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GroupedRouterConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        rope = dict(cfg.get("rope_parameters") or {})
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in cfg:
            cfg = {**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 0.5}}  # HF's default for GLM
        base = DecoderConfig.from_hf(cfg)
        base = type(base)(**{**{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
                             "qk_norm": bool(cfg.get("use_qk_norm", False))})
        scoring = cfg.get("scoring_func", "sigmoid")
        topk_method = cfg.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or topk_method != "noaux_tc":
            key, val = ("scoring_func", scoring) if scoring != "sigmoid" else ("topk_method", topk_method)
            raise NotImplementedError(f"{arch}: {key} {val!r} is not supported (only sigmoid / noaux_tc)")
        experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 128)))
        groups = int(cfg.get("n_group") or 1)
        if experts % groups:
            raise ValueError(f"{arch}: n_routed_experts {experts} is not a multiple of n_group {groups}")
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        layers = base.num_layers
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            fp32_expert_scale=True,
            sparse_layers=tuple(range(first_dense, layers)),
            shared_expert_size=0,
            n_group=groups,
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0),
        )


def grouped_sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, k], int64 ids [T, k]) of noaux_tc routing (module docstring); ids best first by the
    biased score (HF returns them unsorted: the set is the same). Each row alone: batch invariant."""
    scores = invariant_sigmoid(logits.float())
    choice = scores + bias.float()
    T, E = choice.shape
    if n_group > 1:
        groups = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class GroupedMoE(SparseMoE):
    """Router (`mlp.gate`: an fp32 weight and e_score_correction_bias) + stacked experts + shared experts."""

    def __init__(self, cfg: GroupedRouterConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 tp: Solo = SOLO) -> None:
        super().__init__(cfg, dtype, device, kern, tp)
        self.cfg = cfg
        e, h = cfg.num_experts, cfg.hidden_size
        self.gate.weight = _param(e, h, dtype=torch.float32, device=device)  # fp32 whatever the model's, as HF
        self.gate.e_score_correction_bias = _param(e, dtype=torch.float32, device=device)
        self.shared_experts = (MLP(cfg, dtype, device, kern, tp, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 expert weights, int64 expert ids [T, k]) of an fp32 router, whatever the model dtype (as HF)."""
        c = self.cfg
        logits = self.kern.linear(x.float(), self.gate.weight)
        return grouped_sigmoid_route(logits, self.gate.e_score_correction_bias, c.top_k, c.n_group, c.topk_group,
                                     c.norm_topk_prob, c.routed_scaling_factor)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts.partial(x)


class Glm4MoeLM(MoEDecoderLM):
    config_class = GroupedRouterConfig
    sparse_class = GroupedMoE
    cfg: GroupedRouterConfig

    def _weight_targets(self) -> WeightMap:
        t = super()._weight_targets()
        for li in self.cfg.sparse_layers:
            shared = self.model.layers[li].mlp.shared_experts
            if shared is not None:
                self._mlp_targets(t, f"model.layers.{li}.mlp.shared_experts", shared)
        return t

    def skipped_weight(self, name: str) -> bool:
        """The checkpoint's MTP layers, which this decoder does not run."""
        if not name.startswith("model.layers."):
            return False
        layer = name.split(".", 3)[2]
        n = self.cfg.num_layers
        return layer.isdigit() and n <= int(layer) < n + self.cfg.mtp_layers
