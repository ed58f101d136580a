"""Routing decisions that bf16 rounding alone can reverse, for the bf16 oracle tests.

A router's choice is only defined as far as its scores are: where HF's own bf16 computation puts two experts
(or two expert groups) so close that rounding the router's input to bf16 once more could swap them, another
correct bf16 computation of the same model (other rounding places, e.g. DeepSeek-V3's attention absorbed
into the latent space as the engine and vLLM's decode compute it) may take either side, and the token's
output then differs by a whole expert. `tied_flips` finds the tokens where the engine took the other side
of such a decision, and nothing else: the bound is the most one rounding can move each router logit,
sum_j |W[e, j]| * ulp(x_j) / 2 over the router's bf16 input x, and the router rule must pick the engine's
experts once their logits are raised by that bound and every other expert's lowered by it (a sufficient
test: a choice it rejects is not excused). On the tiny DeepSeek-V3 this excuses only the engine's side of
real ties (token 18 of test_bf16_runs_and_agrees_loosely's second prompt: experts 5 and 6 score 0.57806 and
0.57629 in HF bf16, a gap of 0.0018 that one rounding can move by about 0.006), and no other expert set.

Only the noaux_tc router (sigmoid scores plus e_score_correction_bias, group-limited top-k: GLM-4.5,
DeepSeek-V3) is modelled; any other router yields no tied flips, so its tests stay as strict as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _half_ulp(x: torch.Tensor) -> torch.Tensor:
    """The largest error of rounding a real number near each bf16 value x to bf16 (8 significant bits)."""
    a = x.float().abs()
    return torch.where(a > 0, torch.exp2(torch.floor(torch.log2(a)) - 8), torch.zeros_like(a))


def _noaux_tc(scores: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> set[int]:
    """The experts HF's noaux_tc router picks from one token's choice scores [E]."""
    groups = scores.view(n_group, -1)
    kept = groups.topk(2, dim=-1)[0].sum(-1).topk(topk_group)[1]
    mask = torch.full_like(groups, float("-inf"))
    mask[kept] = 0.0
    return set((groups + mask).flatten().topk(top_k)[1].tolist())


def _routers(hf) -> list[torch.nn.Module]:
    """HF's noaux_tc routers in layer order, or [] where the model routes some other way."""
    gates = [getattr(layer.mlp, "gate", None) for layer in hf.model.layers]
    gates = [g for g in gates if g is not None and hasattr(g, "e_score_correction_bias")]
    return gates if gates and getattr(hf.config, "n_group", None) else []


def tied_flips(hf16, ids: list[int], routes: torch.Tensor | None) -> torch.Tensor:
    """bool [len(ids)]: at each token, the lowest MoE layer where the engine's experts (routes [len, layers, k])
    differ from HF bf16's is a decision that one more bf16 rounding of the router's input could give to the
    engine's experts. False wherever the routes agree, and everywhere for a router not modelled here."""
    flips = torch.zeros(len(ids), dtype=torch.bool)
    gates = _routers(hf16)
    if routes is None or not gates:
        return flips
    assert routes.shape[:2] == (len(ids), len(gates)), (routes.shape, len(ids), len(gates))
    inputs: list[torch.Tensor] = []
    hooks = [g.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
             for g in gates]
    try:
        with torch.no_grad():
            hf16(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    c = hf16.config
    for t in range(len(ids)):
        for layer, (gate, x) in enumerate(zip(gates, inputs)):
            w, bias = gate.weight.float(), gate.e_score_correction_bias.float()
            z = F.linear(x[t].float(), w)
            bound = w.abs() @ _half_ulp(x[t])  # [E]: the most one rounding of x moves each logit
            hf_pick = _noaux_tc(z.sigmoid() + bias, c.n_group, c.topk_group, c.num_experts_per_tok)
            ours = set(routes[t, layer].tolist())
            if ours == hf_pick:
                continue
            favour = torch.zeros_like(z, dtype=torch.bool)
            favour[list(ours)] = True  # the engine's experts at the top of their range, the others at the bottom
            extreme = torch.where(favour, z + bound, z - bound).sigmoid() + bias
            flips[t] = _noaux_tc(extreme, c.n_group, c.topk_group, c.num_experts_per_tok) == ours
            break  # a higher layer's difference at this token follows from this one
    return flips
