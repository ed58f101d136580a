"""The panel kernels' one summation order, checked against an oracle that shares no code with them: every
output sums each block of BLOCK products from zero, one fp32 fused multiply-add per k in order, and adds each
block's sum in turn to the bias (or 0), whatever the tile, pass or thread split (ascend_ops/csrc/
cpu_panel_gemm.cpp's header). Row counts that split unevenly into
tiles and 120-row passes, depths past a chunk, outputs past the last whole panel; fp32 and bf16 weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ascend_ops import packed_linear as pl

pytestmark = [pytest.mark.unit, pytest.mark.skipif(pl.available() is not None, reason=str(pl.available()))]

PANELS = [pytest.param(b, marks=pytest.mark.skipif(pl.panel_unavailable(b) is not None,
                                                   reason=str(pl.panel_unavailable(b))))
          for b in pl.PANEL_WIDTHS]


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c rounded once (an FMA), elementwise: the product is exact in fp64; the sum is taken
    in fp64 rounded to odd (its exact error from TwoSum decides the last bit), which then rounds to fp32
    exactly as the exact sum would (53 bits >= 24 + 2)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    fix = (err != 0) & even
    s[fix] = np.nextafter(s[fix], np.where(err[fix] > 0, np.inf, -np.inf))
    return s.astype(np.float32)


BLOCK = 128  # cpu_panel_gemm.cpp's kSumDepth


def oracle(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out = bias (or 0); for each block of BLOCK k: s = 0, s = fma(x[:, k], w[:, k], s) for its k in order,
    out = out + s; all in fp32."""
    xs, ws = x.float().numpy(), w.float().numpy()
    out = np.zeros((xs.shape[0], ws.shape[0]), np.float32)
    if bias is not None:
        out += bias.float().numpy()[None, :]
    for k0 in range(0, xs.shape[1], BLOCK):
        s = np.zeros_like(out)
        for k in range(k0, min(k0 + BLOCK, xs.shape[1])):
            s = fma32(xs[:, k:k + 1], ws[None, :, k], s)
        out = out + s  # fp32 + fp32: one rounding
    return torch.from_numpy(out)


def test_the_oracle_is_a_single_rounding():
    """fma32 against exact rational arithmetic where fp64 alone would round twice."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(4000).astype(np.float32) for _ in range(3))
    c[:2000] *= np.float32(2.0 ** -30)  # tiny addends: the sum's low bits decide the rounding
    got = fma32(a, b, c)
    for i in range(0, 4000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.array(v, np.float32).view(np.int32)) & 1))
        assert got[i] == best, i


@pytest.mark.parametrize("backend", PANELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 40, 130), (13, 100, 257), (37, 72, 64), (121, 33, 140), (250, 64, 96),
                                        (7, 48, 384)])
def test_every_output_is_bias_then_each_blocks_fma_chain_in_order(backend, dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = nn.Parameter(torch.randn(n, k, generator=gen).to(dtype), requires_grad=False)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for bias in (b, None):
                want = oracle(x, w.data, bias).to(dtype)
                assert torch.equal(pl.product(x, w, bias, backend=backend), want), (t, bias is None)
    finally:
        torch.set_num_threads(threads)
