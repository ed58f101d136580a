"""The CPU kernel of the mixed LoRA product (ascend_ops/csrc/cpu_lora.cpp, through workers.lora's hook): equal
to the plain per-adapter product B·(A·x)·scaling, untouched base rows, and each row's bits independent of
its batch-mates (any number of rows, any blocking, other adapters present or not)."""

from __future__ import annotations

import pytest
import torch

from ascend_ops import cpu_kernels
from workers.lora import PANEL, AdapterWeights, LoraSlots, Pair, _panels

pytestmark = pytest.mark.unit


def _pair(rng: torch.Generator, widths: list[int], targeted: list[bool], rank: int, fin: int, dtype):
    """A fused projection's Pair for the kernel, and its dense delta matrix [out, in] for the reference."""
    a_parts, b_parts, ranges, dense = [], [], [], torch.zeros(sum(widths), fin, dtype=torch.float64)
    row = 0
    for w, on in zip(widths, targeted):
        if on:
            a = torch.randn(rank, fin, generator=rng) * 0.3
            bp = torch.randn(w, rank, generator=rng) * 0.3
            a_parts.append(a)
            b_parts.append(bp)
            dense[row:row + w] = bp.double() @ a.double()
            ranges.append((row, row + w))
        row += w
    a = torch.cat(a_parts).to(dtype)
    return Pair(a, None, _panels(b_parts, 1.0).to(dtype), torch.tensor(ranges, dtype=torch.long)), dense


class _Adapter(AdapterWeights):
    def __init__(self, pair: Pair):  # one layer, one projection: "qkv"
        self.layers = [{"qkv": pair}]


def _slots(dtype) -> LoraSlots:
    from ascend_ops.batch_invariant import DEFAULT

    slots = LoraSlots({}, DEFAULT, max_rank=64, max_cached=8, dtype=dtype, device=torch.device("cpu"))
    if not slots.kernel:
        pytest.skip(f"the CPU kernels are unavailable here ({cpu_kernels.unavailable()})")
    return slots


def _run(slots: LoraSlots, adapters: dict, rows: list, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    slots.loaded.clear()
    slots.loaded.update({(k, 1): adapters[k] for k in adapters})
    slots.begin_step([(k, 1) if k is not None else None for k in rows])
    try:
        return slots.hook(0, "qkv")(x, out.clone())
    finally:
        slots.end_step()


@pytest.mark.parametrize("fin,widths,targeted,rank", [
    (40, [48, 16, 16], [True, True, True], 4),     # in not a multiple of 16, widths not of the panel
    (64, [96, 33, 33], [True, False, True], 8),    # a part not targeted: its columns untouched
    (24, [70], [True], 3),                         # odd rank (the shrink's single-row tail)
])
def test_kernel_equals_the_per_adapter_product(fin, widths, targeted, rank):
    slots = _slots(torch.float32)
    rng = torch.Generator().manual_seed(0)
    (pa, da), (pb, db) = (_pair(rng, widths, targeted, rank, fin, torch.float32) for _ in range(2))
    adapters = {1: _Adapter(pa), 2: _Adapter(pb)}
    rows = [1, None, 2, 1, 1, 2, None, 1, 1, 1, 1, 1, 1, 1, 2]  # 10 rows of adapter 1: a block of 8 and of 2
    x = torch.randn(len(rows), fin, generator=rng)
    out = torch.randn(len(rows), sum(widths), generator=rng)
    got = _run(slots, adapters, rows, x, out)
    for i, k in enumerate(rows):
        want = out[i].double() + (0 if k is None else {1: da, 2: db}[k] @ x[i].double())
        assert torch.allclose(got[i].double(), want, atol=1e-5, rtol=1e-5), (i, k)
    assert PANEL == 32


def test_a_rows_bits_do_not_depend_on_its_batch():
    slots = _slots(torch.float32)
    rng = torch.Generator().manual_seed(1)
    widths, fin = [64, 32, 32], 72
    adapters = {k: _Adapter(_pair(rng, widths, [True] * 3, 8, fin, torch.float32)[0]) for k in (1, 2, 3)}
    x = torch.randn(1, fin, generator=rng)
    out = torch.randn(1, sum(widths), generator=rng)
    alone = _run(slots, adapters, [1], x, out)[0]
    for n in (2, 5, 8, 9, 17):  # every block size, the row first, last or in the middle, other adapters around
        for at in (0, n // 2, n - 1):
            rows = [(i % 3) + 1 if i != at else 1 for i in range(n)]
            xs = torch.randn(n, fin, generator=rng)
            xs[at] = x[0]
            outs = torch.randn(n, sum(widths), generator=rng)
            outs[at] = out[0]
            assert torch.equal(_run(slots, adapters, rows, xs, outs)[at], alone), (n, at)


def test_bf16_is_the_fp32_product_rounded():
    slots = _slots(torch.bfloat16)
    rng = torch.Generator().manual_seed(2)
    pair, dense = _pair(rng, [64, 32, 32], [True, True, True], 8, 48, torch.bfloat16)
    x = torch.randn(6, 48, generator=rng).bfloat16()
    out = torch.randn(6, 128, generator=rng).bfloat16()
    got = _run(slots, {1: _Adapter(pair)}, [1] * 6, x, out).double()
    want = out.double() + x.double() @ dense.t()
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
