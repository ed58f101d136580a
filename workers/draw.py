"""The draw: one token per sampled row from its probabilities, by inverse CDF, each seeded row from its own
generator (workers/sampler.py decides which rows draw and from which distribution)."""

from __future__ import annotations

import functools

import torch

from workers.logits_processors import RowState

DRAW_ROWS = 8  # rows per slice of the inverse-CDF draw (8 x 152k vocabulary x float64 = 9.7 MB)


def draw_logprobs(lp: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """`draw_probs(lp.exp(), ...)` for rows of log-probabilities: on CPU one fused kernel (ascend_ops/csrc/
    cpu_sampling.cpp: no [S, V] exp and float64 cumsum; the same uniforms and the same rule, the sums in
    another order), elsewhere, or without the CPU kernels, the torch path."""
    kernel = _draw_kernel() if lp.device.type == "cpu" and lp.dtype == torch.float32 and lp.stride(-1) == 1 else None
    if kernel is None:
        return draw_probs(lp.exp(), rows, default_generator)
    return kernel(lp, uniforms(rows, default_generator))


@functools.cache
def _draw_kernel():
    from ascend_ops.cpu_kernels import ops

    kernels = ops()
    return None if kernels is None else kernels.draw_logprobs


def uniforms(rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """One float64 uniform per row, from the row's own generator when it has a seed."""
    unseeded = sum(r.generator is None for r in rows)
    if unseeded == len(rows):
        return torch.rand(len(rows), dtype=torch.float64, generator=default_generator)
    # the seeded rows' draws gathered in Python, then one tensor: an indexed write per row cost ~1 ms / 64
    shared = iter(torch.rand(unseeded, dtype=torch.float64, generator=default_generator).tolist() if unseeded else [])
    return torch.tensor([next(shared) if r.generator is None else
                         torch.rand(1, dtype=torch.float64, generator=r.generator).item() for r in rows],
                        dtype=torch.float64)


def draw_probs(probs: torch.Tensor, rows: list[RowState], default_generator: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row, from the row's own generator when it has a seed.

    One draw per row (not one per vocabulary entry, as exponential/Gumbel races need) keeps a seeded
    row's randomness tiny and cheap; the cumulative sum runs in float64 so the 50k-entry CDF stays exact
    enough, and `right=True` never lands on a token of zero probability."""
    u = uniforms(rows, default_generator)
    # Rows in slices of DRAW_ROWS through one float64 buffer: a whole [S, V] float64 copy and its cumsum
    # cost more in page faults than in arithmetic (each row's sum runs in the same order either way).
    n, vocab = probs.shape
    out = torch.empty(n, dtype=torch.int64)
    buf = torch.empty(min(n, DRAW_ROWS), vocab, dtype=torch.float64)
    for a in range(0, n, DRAW_ROWS):
        b = min(a + DRAW_ROWS, n)
        cdf = torch.cumsum(probs[a:b], dim=-1, dtype=torch.float64, out=buf[: b - a])
        target = (u[a:b] * cdf[:, -1]).unsqueeze(1)
        out[a:b] = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return out.clamp_(max=vocab - 1)
