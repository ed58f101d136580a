"""Elementwise and normalisation kernels every model goes through.

One place for them so an Ascend kernel (torch_npu.npu_rms_norm, npu_rotary_mul, ...) or a
batch-invariant variant can be swapped in without touching model code. These are the portable versions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as HF (normalise in fp32, scale in the weight dtype) so logits match the oracle.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope_cos_sin(
    head_dim: int, max_positions: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in the HF (rotate-half) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; cos/sin [T, D] already gathered at the tokens' positions."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over the experts, then the top_k: (fp32 weights [T, k], int64 ids [T, k]), best first.

    With `renormalize` the k weights are divided by their sum (Mixtral always, Qwen3-MoE with norm_topk_prob).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k] int64
    expert_weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows first, then up
    down: torch.Tensor,  # [E, H, I]
    mm=linear,  # the GEMM: ascend_ops.batch_invariant passes its row-invariant linear
    act=silu_and_mul,  # and its row-invariant silu_and_mul
) -> torch.Tensor:
    """Sum over each token's k experts of weight * down(silu(gate(x)) * up(x)); [T, H] in x's dtype.

    The T*k (token, expert) pairs are sorted by expert so each expert runs one GEMM pair on its rows (a
    loop over the experts that received tokens, never over tokens). The rows are then put back in
    (token, slot) order and each token sums its own k products: unlike an index_add (atomic adds on a
    GPU), the result does not depend on thread timing or on the other tokens in the batch. As in HF
    transformers, each product is scaled in the promoted dtype of (output, weights), then cast to x's dtype.
    """
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x[order // k]  # row j: the token of sorted pair j
    out = torch.empty_like(xs)
    inter = down.shape[-1]
    start = 0
    for e, n in enumerate(counts):
        if n:
            gu = mm(xs[start : start + n], gate_up[e])
            out[start : start + n] = mm(act(gu[:, :inter], gu[:, inter:]), down[e])
            start += n
    pairs = torch.empty_like(out)
    pairs[order] = out  # back to (token, slot) order
    return (pairs.view(T, k, x.shape[-1]) * expert_weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)
