"""Row-invariant sigmoid, GELU (tanh), clamped SwiGLU and tanh: MoE routers and gates (GLM-4.5, Qwen2-MoE,
Qwen3-Next), Gemma 3's MLP, gpt-oss's experts, Gemma 3's logit cap.

Why the torch ops are not row-invariant on CPU: an elementwise loop runs an op's vectorised kernel over
whole vectors and its scalar kernel over each loop's tail, and a tensor of 32768 elements or more is split
between threads at an element index, in the middle of some row (ascend_ops.batch_invariant's docstring).
Where the two kernels of an op differ, the row a split cuts (or whose elements fall in a tail) gets other
bits than the same row alone. Measured on an Intel Xeon (AVX-512), torch 2.13, fp32, 20,000 inputs of
N(0, 36), the scalar kernel against the vectorised one: F.gelu(approximate="tanh") 944 differ, torch.sigmoid
818, F.silu 841; torch.exp 0, torch.tanh 0.

So each op here is written with exp and IEEE-exact arithmetic only (neg, add, mul, div: correctly rounded
in both kernels), computed in fp32 and rounded once to the input's dtype, the way ascend_ops.batch_invariant
computes SiLU; ascend_ops.batch_invariant_check.self_check re-measures them at start-up with the model's widths
and a row count that puts a thread split inside a row. The forms are equal to HF's in exact arithmetic
(0.5 * (1 + tanh(u)) = sigmoid(2u)); in floats they differ from HF's by a few ulps, far inside the oracle
tests' 1e-4 on logprobs. Default mode keeps HF's own expressions (ascend_ops.ops).
"""

from __future__ import annotations

import math

import torch

_GELU_C = -2.0 * math.sqrt(2.0 / math.pi)  # exp's argument: -2u, u = sqrt(2 / pi) * (x + 0.044715 x^3)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in x's dtype (torch.sigmoid's scalar tail gives an element other bits)."""
    return torch.exp(-x).add_(1).reciprocal_()


def _over_one_plus_exp(num: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """num / (1 + exp(z)), fp32, in z's buffer (z is a temporary of the caller's)."""
    z.exp_()
    z.add_(1)
    return torch.div(num, z, out=z)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x * 0.5 * (1 + tanh(u)) as x / (1 + exp(-2u)), u = sqrt(2 / pi) * (x + 0.044715 x^3); x's dtype."""
    xf = x.float()
    z = xf * xf
    z.mul_(xf).mul_(0.044715).add_(xf).mul_(_GELU_C)
    return _over_one_plus_exp(xf, z).to(x.dtype)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) rounded to gate's dtype, times up (HF's order: the activation, then the product)."""
    return gelu_tanh(gate).mul_(up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit), with
    g * sigmoid(alpha * g) as g / (1 + exp(-alpha * g)) in fp32, rounded once (HF's glu); gate_up [T, 2I]
    holds gate and up interleaved in its columns."""
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    g = gate.float()
    glu = _over_one_plus_exp(g, g * -alpha).to(gate.dtype)
    return up.add_(1).mul_(glu)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) as 2 / (1 + exp(-2x)) - 1 in fp32 (exact at both ends: exp's overflow gives -1), x's dtype."""
    xf = x.float()
    z = xf * -2.0
    z.exp_()
    z.add_(1)
    return z.reciprocal_().mul_(2).sub_(1).to(x.dtype)
