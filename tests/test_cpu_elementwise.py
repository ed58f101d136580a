"""The fused CPU elementwise kernels of the default mode (ascend_ops/csrc/cpu_elementwise.cpp, through
ascend_ops.ops.fused_*) against the torch ops they replace, on random inputs: odd sizes (vector tails),
strided views as the model passes them (q/k/v and gate/up slices of one product), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from ascend_ops import cpu_kernels, ops

DTYPES = [torch.float32, torch.bfloat16]
SIZES = [(1, 7), (5, 64), (64, 576), (3, 1000)]  # rows, width: tails past 8 and 16 lanes included


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if cpu_kernels.ops() is None:
        pytest.fail(f"the CPU kernels did not build here: {cpu_kernels.unavailable()}")


def rand(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
    assert err <= rtol, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SIZES)
def test_rms_norm_and_the_fused_residual_add_match_torch(dtype, rows, width) -> None:
    x, h = rand(rows, width, dtype=dtype, seed=1), rand(rows, width, dtype=dtype, seed=2)
    w = rand(width, dtype=dtype, seed=3)
    # only the sum of squares is reduced in another order: fp32 within a few ulp, bf16 within one bf16 ulp
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    close(ops.fused_rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), tol)
    s, n = ops.fused_add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(s, x + h)
    close(n, ops.rms_norm(x + h, w, 1e-6), tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_the_heads_of_a_strided_q_view(dtype) -> None:
    qkv = rand(6, (4 + 2 * 2) * 32, dtype=dtype)
    q = qkv[:, : 4 * 32].view(6, 4, 32)  # per-head q norm (Qwen3): [T, h, D], rows strided
    w = rand(32, dtype=dtype, seed=4)
    close(ops.fused_rms_norm(q, w, 1e-6), ops.rms_norm(q, w, 1e-6), 1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SIZES)
def test_silu_and_mul_matches_torch(dtype, rows, width) -> None:
    gu = rand(rows, 2 * width, dtype=dtype, seed=5, scale=6.0)  # far into both tails of the sigmoid
    gate, up = gu[:, :width], gu[:, width:]
    want = ops.silu_and_mul(gate, up)
    if dtype == torch.bfloat16:
        assert torch.equal(ops.fused_silu_and_mul(gate, up), want)  # exact division, torch's roundings
    else:
        close(ops.fused_silu_and_mul(gate, up), want, 1e-6)


def test_silu_and_mul_at_extreme_inputs() -> None:
    g = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 88.0, 89.0, 1e30, -88.0, -89.0, -1e30, 20.0, -20.0] * 2])
    got, want = ops.fused_silu_and_mul(g, torch.ones_like(g)), ops.silu_and_mul(g, torch.ones_like(g))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30), (got, want)
    nan = torch.full((1, 16), float("nan"))
    assert ops.fused_silu_and_mul(nan, torch.ones_like(nan)).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,d", [(1, 64), (7, 64), (5, 128), (3, 18)])
def test_rope_is_bitwise_torch(dtype, tokens, d) -> None:
    """Each product rounded, then the sum, as torch's q * cos + rotate_half(q) * sin computes it."""
    hq, hk = 6, 2
    qkv = rand(tokens, (hq + 2 * hk) * d, dtype=dtype, seed=6)
    q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    cos, sin = rand(tokens, d, dtype=dtype, seed=7), rand(tokens, d, dtype=dtype, seed=8)
    before = qkv.clone()
    want_q, want_k = ops.apply_rope(q, k, cos, sin)
    got_q, got_k = ops.fused_apply_rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv, before)  # its inputs untouched


def test_other_dtypes_and_layouts_take_the_torch_path() -> None:
    x, w = rand(4, 10, dtype=torch.float64), rand(10, dtype=torch.float64)
    assert torch.equal(ops.fused_rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    xt = rand(10, 4, dtype=torch.float32).t()  # last dim not contiguous
    assert torch.equal(ops.fused_rms_norm(xt, w.float(), 1e-6), ops.rms_norm(xt, w.float(), 1e-6))
    g = rand(3, 9, dtype=torch.float64)
    assert torch.equal(ops.fused_silu_and_mul(g, g), ops.silu_and_mul(g, g))


def test_bad_shapes_are_refused_by_the_kernels_with_an_error() -> None:
    k = cpu_kernels.ops()
    with pytest.raises(RuntimeError, match="weight is"):
        k.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="gate and up"):
        k.silu_and_mul(torch.randn(3, 8), torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="rope"):
        k.rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(4, 8), torch.randn(4, 8))
