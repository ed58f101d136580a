"""CPU linear on pre-packed weights (ascend_ops.packed_linear): same products as F.linear, and a packed copy
never outlives the values it was packed from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascend_ops import packed_linear as pl

pytestmark = [pytest.mark.unit, pytest.mark.skipif(pl.available() is not None, reason=str(pl.available()))]


def param(*shape: int, dtype=torch.float32, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype),
                        requires_grad=False)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fp32_matches_f_linear(rows):
    w, b = param(1536, 576), torch.randn(1536)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(pl.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=2e-4)


def test_bf16_matches_f_linear_and_3d_inputs_keep_their_shape():
    """bf16 on this CPU's default product (oneDNN's native bf16, else a panel kernel summing in fp32)."""
    w = param(320, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 5, 64).bfloat16()
    got = pl.linear(x, w)
    assert got.shape == (2, 5, 320) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_the_pack_is_made_once_and_reused():
    w = param(64, 32)
    pl.linear(torch.randn(3, 32), w)
    first = w._rollbus_packed[1]
    pl.linear(torch.randn(5, 32), w)
    assert w._rollbus_packed[1] is first


def test_forget_then_in_place_change_serves_the_new_values():
    model = nn.Linear(32, 64, bias=False)
    model.weight.requires_grad_(False)
    x = torch.randn(4, 32)
    pl.linear(x, model.weight)
    with torch.no_grad():
        model.weight.data.mul_(2)  # an in-place write a version counter would not see
    assert pl.forget(model) == 1 and pl.packed_bytes(model) == 0
    torch.testing.assert_close(pl.linear(x, model.weight), F.linear(x, model.weight), rtol=1e-5, atol=1e-5)


def test_a_swapped_data_tensor_is_repacked_without_forget():
    """Sleep and staged updates swap `.data`: the storage address changes, and the pack follows it."""
    w = param(64, 32)
    x = torch.randn(4, 32)
    pl.linear(x, w)
    w.data = torch.randn(64, 32)
    torch.testing.assert_close(pl.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_temporaries_and_other_dtypes_take_f_linear():
    w = param(64, 32)
    view = w[:16]  # a slice (say, one expert of a stacked tensor) is not a Parameter: never packed
    x = torch.randn(2, 32)
    torch.testing.assert_close(pl.linear(x, view), F.linear(x, view))
    w16 = param(8, 32, dtype=torch.float16)
    assert torch.equal(pl.linear(x.half(), w16), F.linear(x.half(), w16))
    assert getattr(w16, "_rollbus_packed", None) is None


def test_model_load_weights_drops_the_packs(tmp_path):
    from tests.tiny_models import load_model, make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint("qwen3", tmp_path / "m"))
    lm = model.lm_head.weight
    x = torch.randn(3, lm.shape[1])
    pl.linear(x, lm)
    assert pl.packed_bytes(model) > 0
    new = torch.randn(tuple(lm.shape))
    model.load_weights([("lm_head.weight", new)])
    assert pl.packed_bytes(model) == 0
    torch.testing.assert_close(pl.linear(x, lm), F.linear(x, new), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_the_packs_before_it_trims_the_heap(tmp_path, monkeypatch, level):
    """Level 2 discards the weights and their packed copies before malloc_trim, and counts the packs as
    released: dropped after the trim (by the worker's command wrapper alone), ~400 MiB of SmolLM2's packs
    stayed resident in the asleep worker's heap in some cycles (CI: 721 MiB asleep against 337). On CPU
    level 1 keeps the weights in place, and their packs with them."""
    from ascend_ops.platform import current_platform
    from tests.tiny_models import load_model, make_tiny_checkpoint
    from workers import sleep as sleep_mod
    from workers.kv_cache import KVCache

    model = load_model(make_tiny_checkpoint("qwen3", tmp_path / "m"))
    lm = model.lm_head.weight
    pl.linear(torch.randn(3, lm.shape[1]), lm)
    packed = pl.packed_bytes(model)
    assert packed > 0
    at_trim: list[int] = []
    monkeypatch.setattr(sleep_mod, "release_host_memory", lambda: at_trim.append(pl.packed_bytes(model)))
    kv = KVCache(1, 1, 8, 4, 2, torch.float32, torch.device("cpu"))
    kv_bytes, weights = kv.nbytes, sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(2, lm.shape[1])
    released = sleep_mod.SleepManager(model, kv, current_platform()).sleep(level)
    assert at_trim == [0 if level == 2 else packed]
    assert released == kv_bytes + (weights + packed if level == 2 else 0)
    if level == 1:  # the weights and their packs stayed
        torch.testing.assert_close(pl.linear(x, lm), F.linear(x, lm), rtol=1e-5, atol=1e-4)


def test_an_in_place_write_through_the_parameter_repacks_without_forget():
    """An optimizer step writes through the parameter (its version counter moves): the next product packs
    the new values."""
    w = nn.Parameter(torch.randn(64, 32))
    x = torch.randn(4, 32)
    with torch.no_grad():
        pl.linear(x, w)
        w.add_(1.0)
        torch.testing.assert_close(pl.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_invariant_linear_trains_with_the_engines_forward_bits():
    """Trainer side (engine.trainer): with autograd the invariant linear's forward is the same packed
    product the engine runs (bitwise), and its gradients are F.linear's."""
    from ascend_ops import batch_invariant as bi

    w, b = nn.Parameter(torch.randn(48, 40)), nn.Parameter(torch.randn(48))
    x = torch.randn(6, 40, requires_grad=True)
    y = bi.linear(x, w, b)
    with torch.inference_mode():
        engine = bi.linear(x.detach(), w, b)
    assert torch.equal(y.detach(), engine)
    g = torch.randn_like(y)
    y.backward(g)
    gx, gw, gb = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    F.linear(x, w, b).backward(g)
    for got, want in ((gx, x.grad), (gw, w.grad), (gb, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_an_unknown_switch_value_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(pl.ENV, value)
    pl.available.cache_clear()
    try:
        want = f"ROLLBUS_CPU_PACKED_LINEAR must be one of 1, 0, onednn, mkl, avx2, avx512, got '{value}'"
        with pytest.raises(ValueError, match=want):
            pl.available()
    finally:
        monkeypatch.delenv(pl.ENV)
        pl.available.cache_clear()


# --- the three fp32 backends ---------------------------------------------------------------------------

needs_mkl = pytest.mark.skipif(pl.mkl_unavailable() is not None, reason=str(pl.mkl_unavailable()))
# each panel kernel this machine has (avx2: 16-wide panels, avx512: 32-wide), the others skipped saying why
PANELS = [pytest.param(b, marks=pytest.mark.skipif(pl.panel_unavailable(b) is not None,
                                                   reason=str(pl.panel_unavailable(b))))
          for b in pl.PANEL_WIDTHS]


@pytest.fixture
def choose(monkeypatch):
    """Set ROLLBUS_CPU_PACKED_LINEAR (and the CPU vendor) for one test; the cached decisions are redone after."""
    def set_(value: str | None = None, vendor: str | None = None, avx512: bool | None = None,
             native: bool | None = None) -> None:
        if value is None:
            monkeypatch.delenv(pl.ENV, raising=False)
        else:
            monkeypatch.setenv(pl.ENV, value)
        if vendor is not None:
            monkeypatch.setattr(pl, "_cpu_vendor", lambda: vendor)
        if avx512 is not None:
            monkeypatch.setattr(pl, "_has_avx512", lambda: avx512)
        if native is not None:
            monkeypatch.setattr(pl, "native_bf16", lambda: native)
        pl.available.cache_clear()
        pl.fp32_backend.cache_clear()
        pl.bf16_backend.cache_clear()

    yield set_
    monkeypatch.undo()
    pl.available.cache_clear()
    pl.fp32_backend.cache_clear()
    pl.bf16_backend.cache_clear()


@needs_mkl
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (192, 576), (1000, 64), (7, 33), (49152, 64)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_mkl_pack_matches_f_linear_at_any_number_of_rows(rows, n, k):
    """One pack serves every row count (torch's own mkl linear uses its pack for one batch size only), on a
    pack mapped zeroed (MKL reads words it does not write: heap memory there gave NaN)."""
    w, b = param(n, k, seed=1), torch.randn(n)
    x = torch.randn(rows, k)
    del_me = torch.full((4 * n * k + 1024,), float("nan"))  # freed heap full of NaN, where a pack could land
    del del_me
    got = pl.product(x, w, b, backend="mkl")
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(pl.product(x.view(1, rows, k), w, None, backend="mkl"),
                               F.linear(x, w).view(1, rows, -1), rtol=1e-5, atol=2e-4)
    assert pl.product(x[:0], w, b, backend="mkl").shape == (0, n)


def test_the_default_backend_per_cpu(choose):
    """Intel with AVX-512: the AVX-512 panel kernel; other Intel: MKL; other vendors with AVX2 but no AVX-512:
    the AVX2 panel kernel; everything else (AMD Zen 4): oneDNN. Each falls back where it is missing."""
    choose(None, vendor="AuthenticAMD", avx512=True)
    assert pl.fp32_backend() == "onednn" and pl.describe(torch.float32) == "onednn-prepacked"
    choose(None, vendor="AuthenticAMD", avx512=False)
    want = "avx2" if pl.panel_unavailable() is None else "onednn"
    assert pl.fp32_backend() == want and pl.describe(torch.float32) == f"{want}-prepacked"
    choose("onednn", vendor="GenuineIntel")
    assert pl.fp32_backend() == "onednn"
    choose("onednn", vendor="AuthenticAMD", avx512=False)
    assert pl.fp32_backend() == "onednn"
    mkl = "mkl" if pl.mkl_unavailable() is None else "onednn"
    choose(None, vendor="GenuineIntel", avx512=False)
    assert pl.fp32_backend() == mkl and pl.describe(torch.float32) == f"{mkl}-prepacked"
    choose(None, vendor="GenuineIntel", avx512=True)
    want = "avx512" if pl.panel_unavailable("avx512") is None else mkl
    assert pl.fp32_backend() == want and pl.describe(torch.float32) == f"{want}-prepacked"
    choose("0")
    assert pl.describe(torch.float32).startswith("torch (packed off")


def test_asking_for_mkl_where_it_is_missing_is_refused_naming_why(choose, monkeypatch):
    monkeypatch.setattr(pl, "mkl_unavailable", lambda: "this torch build exports no MKL packed sgemm")
    choose("mkl")
    with pytest.raises(ValueError, match="ROLLBUS_CPU_PACKED_LINEAR=mkl: this torch build exports no MKL"):
        pl.fp32_backend()


@pytest.mark.parametrize("backend, why", [("avx2", "the CPU kernels were compiled without AVX2 and FMA"),
                                          ("avx512", "the CPU kernels were compiled without AVX-512")])
def test_asking_for_a_panel_kernel_where_it_is_missing_is_refused_naming_why(choose, monkeypatch, backend, why):
    monkeypatch.setattr(pl, "panel_unavailable", lambda b="avx2": why if b == backend else None)
    choose(backend)
    with pytest.raises(ValueError, match=f"ROLLBUS_CPU_PACKED_LINEAR={backend}: {why}"):
        pl.fp32_backend()


@needs_mkl
def test_each_backend_keeps_its_own_pack_and_the_invariant_linear_multiplies_on_the_default_one(choose):
    """Switching backends repacks; the batch-invariant linear gives default mode's bits (the same pack), and
    its rows are the same bits whatever the batch (padded to 4 rows), on MKL's pack as on oneDNN's."""
    from ascend_ops import batch_invariant as bi

    w = param(1536, 576, seed=2)
    x = torch.randn(70, 576)
    for backend in ("onednn", "mkl", "onednn"):
        choose(backend)
        got = pl.linear(x, w)
        assert w._rollbus_packed[0][2] == backend
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=2e-4)
        with torch.inference_mode():
            assert torch.equal(bi.linear(x[:8], w), pl.linear(x[:8], w))
            whole = bi.linear(x, w)
            for m in (1, 5, 13, 33, 64):
                assert torch.equal(bi.linear(x[:m], w), whole[:m]), (backend, m)


@needs_mkl
def test_the_mkl_kernels_refuse_bad_operands_with_an_error():
    from ascend_ops import cpu_kernels

    ops = cpu_kernels.ops()
    with pytest.raises(RuntimeError, match="mkl_pack: a 2-D float32"):
        ops.mkl_pack(torch.randn(4, 4).bfloat16(), 64)
    packed = ops.mkl_pack(torch.randn(16, 8), 64)
    with pytest.raises(RuntimeError, match="mkl_packed_linear: bias"):
        ops.mkl_packed_linear(torch.randn(2, 8), packed, 16, 8, torch.randn(3))
    with pytest.raises(RuntimeError, match="mkl_packed_linear: x is a 2-D float32"):
        ops.mkl_packed_linear(torch.randn(2, 8).double(), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        ops.mkl_packed_linear(torch.randn(2, 9), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="the pack is smaller than a .1600, 8. weight"):
        ops.mkl_packed_linear(torch.randn(2, 8), packed, 1600, 8, None)


# --- the panel kernels, AVX2 and AVX-512 (ascend_ops/csrc/cpu_panel_gemm.cpp) ----------------------------

@pytest.mark.parametrize("backend", PANELS)
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (960, 576), (1000, 64), (7, 33), (49152, 64), (17, 257),
                                  (40, 130)])
@pytest.mark.parametrize("rows", [1, 5, 7, 12, 13, 64, 85, 121, 300])
def test_the_panel_kernel_matches_f_linear_at_any_shape(rows, n, k, backend):
    """Outputs past the last whole panel (n % 16, n % 32: 7, 17, 40), depth past a chunk (k 130, 257, 576,
    1536), rows in tiles of 1-6 / 1-12 and past the 120-row pass (121, 300), with and without bias, 2-D and
    3-D inputs."""
    w, b = param(n, k, seed=3), torch.randn(n)
    x = torch.randn(rows, k)
    torch.testing.assert_close(pl.product(x, w, b, backend=backend), F.linear(x, w, b), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(pl.product(x.view(1, rows, k), w, None, backend=backend),
                               F.linear(x, w).view(1, rows, -1), rtol=1e-5, atol=2e-4)
    assert pl.product(x[:0], w, b, backend=backend).shape == (0, n)


@pytest.mark.parametrize("backend", PANELS)
def test_a_panel_kernel_row_is_the_same_bits_in_any_batch_and_on_any_number_of_threads(backend):
    """Row invariance by construction (one k order per output, whatever the tile, pass or thread), without
    the invariant linear's padding: every row of every batch size and thread count equals the 300-row batch's."""
    w, b = param(3072, 576, seed=4), torch.randn(3072)
    x = torch.randn(300, 576)
    threads = torch.get_num_threads()
    whole = pl.product(x, w, b, backend=backend)
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 64, 85, 119, 120, 121, 299):
                assert torch.equal(pl.product(x[:m], w, b, backend=backend), whole[:m]), (t, m)
            assert torch.equal(pl.product(x[150:151], w, b, backend=backend)[0], whole[150]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(any(pl.panel_unavailable(b) for b in pl.PANEL_WIDTHS), reason="needs both panel kernels")
def test_the_two_panel_kernels_give_the_same_bits():
    """Both sum the same 128-deep blocks in the same order: a 16-wide and a 32-wide pack give one result, bit for bit
    (the same trajectories on an AVX2 host and an AVX-512 one)."""
    w, b = param(1000, 576, seed=6), torch.randn(1000)
    x = torch.randn(77, 576)
    assert torch.equal(pl.product(x, w, b, backend="avx2"), pl.product(x, w, b, backend="avx512"))


@pytest.mark.parametrize("backend", PANELS)
def test_the_panel_backend_packs_once_and_the_invariant_linear_multiplies_on_it(choose, backend):
    from ascend_ops import batch_invariant as bi

    choose(backend)
    w = param(1536, 576, seed=5)
    x = torch.randn(70, 576)
    got = pl.linear(x, w)
    assert w._rollbus_packed[0][2] == backend and pl.describe(torch.float32) == f"{backend}-prepacked"
    first = w._rollbus_packed[1]
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=2e-4)
    with torch.inference_mode():
        assert torch.equal(bi.linear(x[:8], w), pl.linear(x[:8], w))
        whole = bi.linear(x, w)
        for m in (1, 5, 13, 33, 64):
            assert torch.equal(bi.linear(x[:m], w), whole[:m]), m
    assert w._rollbus_packed[1] is first


@pytest.mark.parametrize("backend", PANELS)
def test_the_panel_kernels_refuse_bad_operands_with_an_error(backend):
    from ascend_ops import cpu_kernels

    ops, width = cpu_kernels.ops(), pl.PANEL_WIDTHS[backend]
    with pytest.raises(RuntimeError, match="panel_pack: a float32 or bfloat16 CPU weight"):
        ops.panel_pack(torch.randn(4, 4).half(), width)
    with pytest.raises(RuntimeError, match="panel_pack: a panel width is 16 .AVX2. or 32 .AVX-512., not 8"):
        ops.panel_pack(torch.randn(4, 4), 8)
    packed = ops.panel_pack(torch.randn(16, 8), width)
    with pytest.raises(RuntimeError, match="panel_linear: bias"):
        ops.panel_linear(torch.randn(2, 8), packed, 16, 8, torch.randn(3), width)
    with pytest.raises(RuntimeError, match="panel_linear: x is a 2-D CPU tensor .rows, in_features. of the pack's"):
        ops.panel_linear(torch.randn(2, 8).double(), packed, 16, 8, None, width)
    with pytest.raises(RuntimeError, match="of the pack's dtype"):  # bf16 x on an fp32 pack, and the reverse
        ops.panel_linear(torch.randn(2, 8).bfloat16(), packed, 16, 8, None, width)
    with pytest.raises(RuntimeError, match="of the pack's dtype"):
        ops.panel_linear(torch.randn(2, 8), ops.panel_pack(torch.randn(16, 8).bfloat16(), width), 16, 8, None, width)
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        ops.panel_linear(torch.randn(2, 9), packed, 16, 8, None, width)
    with pytest.raises(RuntimeError, match="the pack is not a .1600, 8. weight's of width"):
        ops.panel_linear(torch.randn(2, 8), packed, 1600, 8, None, width)
    if backend == "avx512":  # a 16-wide pack (3 panels of a [40, 8] weight) is not a 32-wide one (2 panels)
        with pytest.raises(RuntimeError, match="the pack is not a .40, 8. weight's of width 32"):
            ops.panel_linear(torch.randn(2, 8), ops.panel_pack(torch.randn(40, 8), 16), 40, 8, None, 32)


# --- bf16 on the panel kernels (CPUs without native bf16) ----------------------------------------------------

# --- an MoE layer's experts in one call (panel_grouped_linear) --------------------------------------------------


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("backend", PANELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(96, 64), (100, 72), (7, 33)])
def test_the_grouped_product_is_each_experts_panel_product_bit_for_bit(backend, dtype, n, k):
    """Groups of 0, 1, a tile's, several tiles' and more than a row chunk's rows (121: two passes), in one call:
    each row's outputs are the bits panel_linear gives it on its own expert's weight, within fp32 rounding of the
    fp64 product."""
    from ascend_ops import cpu_kernels

    ops, width = cpu_kernels.ops(), pl.PANEL_WIDTHS[backend]
    gen = torch.Generator().manual_seed(3)
    counts = [3, 0, 13, 1, 121, 0, 5, 12]
    w = torch.randn(len(counts), n, k, generator=gen).to(dtype)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)
    off = _offsets(counts)
    got = ops.panel_grouped_linear(x, ops.panel_pack(w, width), off, n, k, width)
    assert got.dtype == dtype and got.shape == (sum(counts), n)
    alone = [ops.panel_linear(x[off[g]:off[g + 1]], ops.panel_pack(w[g], width), n, k, None, width)
             for g in range(len(counts))]
    assert torch.equal(got, torch.cat(alone))
    exact = torch.cat([x[off[g]:off[g + 1]].double() @ w[g].double().T for g in range(len(counts))])
    tol = 1e-4 if dtype == torch.float32 else 2.0 ** -7 * exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= tol


@pytest.mark.parametrize("backend", PANELS)
def test_the_grouped_product_refuses_bad_operands_with_an_error(backend):
    from ascend_ops import cpu_kernels

    ops, width = cpu_kernels.ops(), pl.PANEL_WIDTHS[backend]
    packed = ops.panel_pack(torch.randn(3, 16, 8), width)
    x = torch.randn(5, 8)
    cases = [
        ((x, packed, _offsets([2, 0]), 16, 8), "offsets is int64 .groups . 1."),
        ((x, packed, _offsets([2, 0, 3]).int(), 16, 8), "offsets is int64"),
        ((x, packed, torch.tensor([1, 2, 4, 5]), 16, 8), "offsets run from 0 to the rows of x"),
        ((x, packed, _offsets([2, 0, 2]), 16, 8), "offsets run from 0 to the rows of x"),
        ((x, packed, torch.tensor([0, 4, 3, 5]), 16, 8), "offsets decrease at group 1"),
        ((torch.randn(5, 9), packed, _offsets([2, 0, 3]), 16, 8), "x has 9 features, the weights 8"),
        ((x.double(), packed, _offsets([2, 0, 3]), 16, 8), "of the pack's dtype"),
        ((x, packed, _offsets([2, 0, 3]), 48, 8), "the pack is not a stack of .48, 8. weights'"),
        ((x, packed.view(-1), _offsets([2, 0, 3]), 16, 8), "the pack is not a stack"),
    ]
    for args, why in cases:
        with pytest.raises(RuntimeError, match=f"panel_grouped_linear: .*{why}"):
            ops.panel_grouped_linear(*args, width)


@pytest.mark.parametrize("backend", PANELS)
def test_moe_experts_take_the_grouped_product_on_a_panel_backend_and_repack_after_a_write(choose, backend):
    """Default mode's MoE (ascend_ops.batch_invariant.DEFAULT) multiplies every expert in one grouped call on the
    panel backend: the same bits as the experts one by one on each one's panel product, close to F.linear's; an
    in-place write to the experts (a weight update) is seen on the next call. A backend without a panel kernel
    (oneDNN) multiplies expert by expert."""
    from ascend_ops import batch_invariant as bi
    from ascend_ops import cpu_kernels
    from ascend_ops import ops as _ops

    choose(backend)
    ops, width = cpu_kernels.ops(), pl.PANEL_WIDTHS[backend]
    e, h, inter, t, k = 6, 64, 48, 9, 2
    gate_up, down = param(e, 2 * inter, h, seed=1), param(e, h, inter, seed=2)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)

    def panel(a, w):
        return ops.panel_linear(a.contiguous(), ops.panel_pack(w, width), w.shape[0], w.shape[1], None, width)

    got = bi.DEFAULT.moe_experts(x, ids, wts, gate_up, down)
    assert gate_up._rollbus_packed[0][2] == backend and down._rollbus_packed[0][2] == backend
    assert torch.equal(got, _ops.moe_experts(x, ids, wts, gate_up, down, mm=panel))
    scale = got.abs().max().item()  # sums of products with cancellations: a tolerance on the output's scale
    torch.testing.assert_close(got, _ops.moe_experts(x, ids, wts, gate_up, down), rtol=1e-5, atol=1e-5 * scale)
    with torch.no_grad():
        down.mul_(2.0)  # exact: every product doubles
    assert torch.equal(bi.DEFAULT.moe_experts(x, ids, wts, gate_up, down), 2.0 * got)
    choose("onednn")
    fresh_up, fresh_down = param(e, 2 * inter, h, seed=1), param(e, h, inter, seed=2)
    assert torch.equal(bi.DEFAULT.moe_experts(x, ids, wts, fresh_up, fresh_down),
                       _ops.moe_experts(x, ids, wts, fresh_up, fresh_down))
    assert getattr(fresh_up, "_rollbus_packed", None) is None


def test_the_bf16_backend_per_cpu(choose, monkeypatch):
    """Native bf16 (AVX512-BF16 / AMX): oneDNN's; without: the widest panel kernel (under `onednn`: oneDNN's
    emulated bf16 where it has one, else F.linear); `avx2` / `avx512` choose that panel kernel for bf16 too,
    whatever the CPU."""
    widest = next((b for b in ("avx512", "avx2") if pl.panel_unavailable(b) is None), None)
    choose(None, native=True)
    assert pl.bf16_backend() == "onednn" and pl.describe(torch.bfloat16) == "onednn-prepacked"
    choose(None, native=False)
    assert pl.bf16_backend() == widest
    if widest:
        assert pl.describe(torch.bfloat16) == f"{widest}-prepacked (bf16 weights, fp32 sums)"
    choose("mkl" if pl.mkl_unavailable() is None else "1", native=False)
    assert pl.bf16_backend() == widest
    choose("onednn", native=False)
    assert pl.bf16_backend() == ("onednn" if torch.bfloat16 in pl._dtypes() else None)
    monkeypatch.setattr(pl, "_dtypes", lambda: (torch.float32,))  # oneDNN without any bf16 path (AMD Zen 3)
    choose("onednn", native=False)
    assert pl.bf16_backend() is None and pl.describe(torch.bfloat16) == "torch (no packed bf16 product on this CPU)"
    w = param(64, 32, dtype=torch.bfloat16)
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(pl.linear(x, w), F.linear(x, w)) and getattr(w, "_rollbus_packed", None) is None
    monkeypatch.undo()
    choose("onednn", native=True)
    assert pl.bf16_backend() == "onednn"
    for b in pl.PANEL_WIDTHS:
        if pl.panel_unavailable(b) is None:
            choose(b, native=True)
            assert pl.bf16_backend() == b and pl.describe(torch.bfloat16) == f"{b}-prepacked (bf16 weights, fp32 sums)"


@pytest.mark.parametrize("backend", PANELS)
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (1000, 64), (7, 33)])
def test_bf16_on_a_panel_kernel_is_the_fp32_kernel_on_the_widened_operands_rounded_once(backend, n, k):
    """Exact widening, fp32 sums in the fp32 kernel's order, one rounding: bit for bit the fp32 kernel's
    result rounded to bf16, and within one bf16 rounding of torch's bf16 linear (which also sums in fp32)."""
    w = param(n, k, dtype=torch.bfloat16, seed=7)
    w32 = param(n, k, seed=7)
    w32.data = w.data.float()
    b = torch.randn(n).bfloat16()
    x = torch.randn(2, 39, k).bfloat16()
    got = pl.product(x, w, b, backend=backend)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 39, n)
    assert torch.equal(got, pl.product(x.float(), w32, b.float(), backend=backend).bfloat16())
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=2 ** -7)
    assert pl.product(x[0, :0], w, b, backend=backend).shape == (0, n)


@pytest.mark.parametrize("backend", PANELS)
def test_bf16_on_a_panel_kernel_is_row_invariant_and_the_invariant_linear_uses_it(choose, backend):
    """Any rows, any threads: a row's bits never depend on the batch; the batch-invariant linear multiplies
    on the same pack (no 32-row pieces: that is oneDNN's bf16 only)."""
    from ascend_ops import batch_invariant as bi

    choose(backend)
    w = param(1000, 576, dtype=torch.bfloat16, seed=8)
    b = torch.randn(1000).bfloat16()
    x = torch.randn(200, 576).bfloat16()
    whole = pl.linear(x, w, b)
    assert w._rollbus_packed[0][2] == backend and w._rollbus_packed[1].dtype == torch.bfloat16
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in (1, 3, 6, 7, 13, 64, 121):
                assert torch.equal(pl.linear(x[:m], w, b), whole[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)
    with torch.inference_mode():
        assert torch.equal(bi.linear(x, w, b), whole)
        assert torch.equal(bi.linear(x[:5], w, b), whole[:5])


def test_native_bf16_means_bf16_instructions_on_x86(monkeypatch):
    """oneDNN takes bf16 on any AVX-512 CPU (emulated without bf16 instructions): native only with them."""
    from ascend_ops import cpu_kernels

    if torch.bfloat16 not in pl._dtypes():
        pytest.skip("oneDNN has no bf16 path here")
    for flags, want in [({"avx2", "avx512f"}, False), ({"avx2", "avx512f", "avx512_bf16"}, True),
                        ({"avx2", "amx_bf16"}, True), ({"avx2", "avx_ne_convert"}, True), (set(), True)]:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda f=flags: f)
        assert pl.native_bf16() is want, flags
