"""Elementwise and normalisation kernels every model goes through.

One place for them so an Ascend kernel (torch_npu.npu_rms_norm, npu_rotary_mul, ...) or a
batch-invariant variant can be swapped in without touching model code. The plain functions are the
portable versions (the batch-invariant kernels use them); the fused_* ones are what the default mode
runs: on CPU, for fp32 and bf16, one C++ call each (ascend_ops/csrc/cpu_elementwise.cpp, torch's arithmetic
step by step), else, and without the extension (ROLLBUS_CPU_KERNELS=0, no compiler), the portable version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_ops import cpu_kernels

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_ops(*ts: torch.Tensor):
    """torch.ops.rollbus_cpu where every tensor is a CPU fp32/bf16 one of the first's dtype, else None."""
    x = ts[0]
    if x.device.type != "cpu" or x.dtype not in _FUSED_DTYPES or any(t.dtype != x.dtype for t in ts):
        return None
    return cpu_kernels.ops()


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


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation, HF's gelu_pytorch_tanh) of gate, times up: Gemma 3's MLP."""
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of an expert's product [T, 2I] (gate and up interleaved in its columns), as HF:
    (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit)."""
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = _cpu_ops(x, weight)
    if k is None or x.dim() not in (2, 3) or x.stride(-1) != 1:
        return rms_norm(x, weight, eps)
    return k.rms_norm(x, weight.contiguous(), eps)


def fused_add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)): the residual add and the norm that follows it, in one pass."""
    k = _cpu_ops(x, h, weight)
    if k is None or x.dim() != 2 or x.shape != h.shape or x.stride(-1) != 1 or h.stride(-1) != 1:
        s = x + h
        return s, rms_norm(s, weight, eps)
    return k.add_rms_norm(x, h, weight.contiguous(), eps)


def fused_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    k = _cpu_ops(gate, up)
    if k is None or gate.dim() != 2 or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_and_mul(gate, up)
    return k.silu_and_mul(gate, up)


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


def fused_apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope in one pass over q and k (strided slices of the q/k/v product are fine)."""
    kern = _cpu_ops(q, k, cos, sin)
    if (kern is None or q.dim() != 3 or k.dim() != 3 or q.shape[-1] % 2 or q.stride(-1) != 1 or k.stride(-1) != 1
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return apply_rope(q, k, cos, sin)
    return kern.rope(q, k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head's own linear: x [T, H, K], w [H, N, K] (linear's [out, in] per head) -> [T, H, N] (MLA's
    absorbed projections: a query into the latent space, a latent output into the value heads)."""
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


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
    act=None,  # default: fused_silu_and_mul; ascend_ops.batch_invariant passes its row-invariant one
    lora=None,  # LoRA on the experts (workers/lora.py's expert_hook): (param, e, tokens, x, out) -> out
    grouped=None,  # every expert's GEMM in one call (packed_linear.grouped_linear), or None where it cannot
) -> torch.Tensor:
    """Sum over each token's k experts of weight * down(silu(gate(x)) * up(x)); [T, H] in x's dtype.

    The T*k (token, expert) pairs are sorted by expert so each expert runs one GEMM pair on its rows (a
    loop over the experts that received tokens, never over tokens). The rows are then put back in
    (token, slot) order and each token sums its own k products: unlike an index_add (atomic adds on a
    GPU), the result does not depend on thread timing or on the other tokens in the batch. As HF transformers'
    default experts (grouped_mm), each product is scaled in the promoted dtype of (output, weights) and a
    token's k products are summed in that dtype, then cast to x's dtype once: with fp32 weights (Mixtral,
    GLM, DeepSeek-V3) a bf16 model rounds the sum once, not each of its k terms.

    `grouped` (default mode on CPU, no LoRA): the experts' products in two calls, gate_up then down, each one
    kernel over every (expert, weight panel) pair with rows: a decode step of an MoE with many experts reads each
    expert's weights once, split between the threads by expert, instead of 2 x E small GEMMs that each split
    a few rows' work between the threads. Each row's products are then the panel kernel's (the bits
    `packed_linear.linear` gives on its expert's weight alone) instead of `mm`'s.
    """
    act = act or fused_silu_and_mul
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bins = torch.bincount(flat, minlength=gate_up.shape[0])
    counts = bins.tolist()
    tokens = order // k
    xs = x[tokens]  # row j: the token of sorted pair j
    inter = down.shape[-1]
    out = None
    if grouped is not None and lora is None:
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        torch.cumsum(bins, 0, out=offsets[1:])
        gu = grouped(xs, gate_up, offsets)
        if gu is not None:
            out = grouped(act(gu[:, :inter], gu[:, inter:]), down, offsets)
    if out is None:
        out = _expert_by_expert(xs, tokens, counts, gate_up, down, mm, act, lora, inter)
    pairs = torch.empty_like(out)
    pairs[order] = out  # back to (token, slot) order
    return (pairs.view(T, k, x.shape[-1]) * expert_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _expert_by_expert(xs: torch.Tensor, tokens: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                      down: torch.Tensor, mm, act, lora, inter: int) -> torch.Tensor:
    """moe_experts' products one expert at a time: its sorted rows (xs, from `tokens`) through gate_up, the
    activation and down."""
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            gu = mm(xs[rows], gate_up[e])
            if lora is None:
                out[rows] = mm(act(gu[:, :inter], gu[:, inter:]), down[e])
            else:  # each adapter row's delta after each base product, as a LoRA'd linear (h: contiguous)
                gu = lora("gate_up_proj", e, tokens[rows], xs[rows], gu)
                h = act(gu[:, :inter], gu[:, inter:]).contiguous()
                out[rows] = lora("down_proj", e, tokens[rows], h, mm(h, down[e]))
            start += n
    return out
