"""The CPU prefill-chunk attention kernel (ascend_ops/csrc/cpu_prefill_attention.cpp), which default mode's
paged_attention runs for prefill chunks of two rows or more in fp32 and bf16: against an fp64 reference on
scattered blocks (fresh prompts, chunks after cached context, GQA / MQA / MHA, head dims 32-576, 16-bit caches),
a row's bits whatever the chunking, the route paged_attention takes, and refused bad input."""

from __future__ import annotations

import pytest
import torch

from ascend_ops import attention, cpu_kernels
from ascend_ops.attention import AttentionMetadata, PrefillChunk

BS = 16
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ops():
    got = cpu_kernels.ops()
    if got is None:
        pytest.fail(f"the CPU kernels did not build here: {cpu_kernels.unavailable()}")
    if got.prefill_attention_width() == 0:
        pytest.skip("a portable build (no AVX2): prefill chunks take torch's flash attention here")
    attention.select("kernel")
    yield got
    attention._cpu_choice.clear()


def case(rows: int, first: int, hq: int, hk: int, d: int, dtype=torch.float32, seed: int = 0, q_dtype=torch.float32):
    """A chunk of `rows` queries at positions first .. first + rows - 1 over a cache whose blocks are shuffled."""
    gen = torch.Generator().manual_seed(seed)
    nblk = (first + rows + BS - 1) // BS
    total = 2 * nblk + 3
    k_cache = torch.randn(total, BS, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, BS, hk, d, generator=gen).to(dtype)
    table = torch.randperm(total, generator=gen)[:nblk]
    q = torch.randn(rows, hq, d, generator=gen).to(q_dtype)
    return q, k_cache, v_cache, table


def gathered(cache: torch.Tensor, table: torch.Tensor, ctx: int, hq: int) -> torch.Tensor:
    """The first ctx positions' rows of the blocks in `table`, [Hq, ctx, D], each KV head repeated per query head."""
    hk, d = cache.shape[2:]
    return cache.index_select(0, table).reshape(-1, hk, d)[:ctx].transpose(0, 1).repeat_interleave(hq // hk, 0)


def reference(q, k_cache, v_cache, table, first: int, scale: float, window: int = 0) -> torch.Tensor:
    rows, hq, _ = q.shape
    ctx = first + rows
    k, v = gathered(k_cache, table, ctx, hq).double(), gathered(v_cache, table, ctx, hq).double()
    s = q.double().transpose(0, 1) @ k.transpose(-1, -2) * scale
    kpos, qpos = torch.arange(ctx)[None, :], torch.arange(first, ctx)[:, None]
    hidden = (kpos > qpos) | ((kpos <= qpos - window) if window else False)
    return (torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v).transpose(0, 1)


def attend(ops, q, k_cache, v_cache, table, first: int, scale: float, window: int = 0) -> torch.Tensor:
    out = torch.empty_like(q)
    ops.prefill_attention(out, q, k_cache, v_cache, table, first, scale, window)
    return out


@pytest.mark.parametrize("rows, first, hq, hk, d", [
    (300, 0, 9, 3, 64),      # SmolLM2's heads, a fresh prompt
    (100, 437, 9, 3, 64),    # a chunk after cached context
    (33, 70, 16, 8, 128),    # Qwen3-0.6B's heads
    (40, 25, 8, 1, 576),     # MQA over one wide plane (DeepSeek-V3's absorbed MLA cache)
    (17, 0, 6, 6, 32),       # MHA, a narrow head
    (50, 3, 10, 2, 64),      # G = 5: tiles of 9 rows, 45 query lanes
])
def test_matches_the_fp64_reference(ops, rows, first, hq, hk, d) -> None:
    q, kc, vc, table = case(rows, first, hq, hk, d, seed=rows + first)
    got = attend(ops, q, kc, vc, table, first, d ** -0.5)
    err = (got.double() - reference(q, kc, vc, table, first, d ** -0.5)).abs().max().item()
    assert err < 5e-6, err


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_caches_are_read_exactly(ops, cache_dtype) -> None:
    """--kv-cache-dtype under an fp32 model: the kernel widens the cached keys and values exactly, so it is as
    close to the reference over the rounded cache as over an fp32 one."""
    q, kc, vc, table = case(70, 30, 9, 3, 64, dtype=cache_dtype, seed=5)
    got = attend(ops, q, kc, vc, table, 30, 0.125)
    assert got.dtype == torch.float32
    assert (got.double() - reference(q, kc.float(), vc.float(), table, 30, 0.125)).abs().max().item() < 5e-6


@pytest.mark.parametrize("hq, hk, dtype", [(9, 3, torch.float32), (16, 8, torch.float32), (4, 4, torch.float32),
                                          (9, 3, torch.bfloat16)])
def test_a_row_is_the_same_bits_however_its_prompt_is_chunked(ops, hq, hk, dtype) -> None:
    """Every query's sums run over the keys in order, and a key past its position adds an exact 0: a row's
    output is the same bits whether its prompt is computed whole or in chunks of any size (tiles differ)."""
    rows = 211
    q, kc, vc, table = case(rows, 0, hq, hk, 64, dtype=dtype, seed=hq, q_dtype=dtype)
    whole = attend(ops, q, kc, vc, table, 0, 0.125)
    for cuts in ([1, 17, 64, 129, 200], [5, 6, 7, 100], [50, 150]):
        pieces, a = [], 0
        for b in [*cuts, rows]:
            pieces.append(attend(ops, q[a:b].contiguous(), kc, vc, table, a, 0.125))
            a = b
        assert torch.equal(torch.cat(pieces), whole), cuts


@pytest.mark.parametrize("rows, first, window", [(300, 0, 7), (300, 0, 64), (100, 437, 128), (40, 900, 4096),
                                                (64, 33, 16), (211, 0, 200)])
@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (4, 1, 256)])
def test_a_sliding_window_matches_the_fp64_reference_and_reads_no_block_before_it(ops, rows, first, window, hq, hk,
                                                                                  d) -> None:
    """A sliding-window layer's chunk (windows shorter than a block, one block, across many, longer than the
    context; Gemma 3's head size of 256 and one KV head): row i sees the keys after first + i - window only. The
    blocks wholly before the first row's window are given back (-1 in the table) and the others poisoned with
    NaN: a read of either is an error or a NaN, not a near miss."""
    q, kc, vc, table = case(rows, first, hq, hk, d, seed=rows + window)
    want = reference(q, kc, vc, table, first, d ** -0.5, window)
    gone = max(0, first - window + 1) // BS
    table = table.clone()
    used = torch.zeros(kc.shape[0], dtype=torch.bool)
    used[table[gone:]] = True
    table[:gone] = -1
    kc[~used], vc[~used] = float("nan"), float("nan")
    got = attend(ops, q, kc, vc, table, first, d ** -0.5, window)
    assert (got.double() - want).abs().max().item() < 5e-6


@pytest.mark.parametrize("window", [5, 16, 70])
def test_with_a_window_a_row_is_the_same_bits_however_its_prompt_is_chunked(ops, window) -> None:
    """Keys before a query's window add exact zeros as keys past its position do, so the tiles' windows (each
    starts at its first row's) change no row's bits."""
    rows, hq, hk = 211, 9, 3
    q, kc, vc, table = case(rows, 0, hq, hk, 64, seed=window)
    whole = attend(ops, q, kc, vc, table, 0, 0.125, window)
    for cuts in ([1, 17, 64, 129, 200], [5, 6, 7, 100]):
        pieces, a = [], 0
        for b in [*cuts, rows]:
            pieces.append(attend(ops, q[a:b].contiguous(), kc, vc, table, a, 0.125, window))
            a = b
        assert torch.equal(torch.cat(pieces), whole), cuts


@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (16, 8, 128)])
def test_bf16_queries_round_as_torchs_flash_attention(ops, hq, hk, d) -> None:
    """A bf16 model: computed in fp32, the softmax numerators rounded to bf16 before they weigh the values, the
    output rounded once. Within a bf16 rounding of the fp64 reference, and of torch's own bf16 flash attention
    on the same blocks (a different summation order, the same rounding places)."""
    rows, first = 150, 60
    q, kc, vc, table = case(rows, first, hq, hk, d, dtype=torch.bfloat16, seed=d, q_dtype=torch.bfloat16)
    got = attend(ops, q, kc, vc, table, first, d ** -0.5)
    assert got.dtype == torch.bfloat16
    ref = reference(q, kc, vc, table, first, d ** -0.5)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 2 ** -7
    ctx = first + rows
    k, v = gathered(kc, table, ctx, hq), gathered(vc, table, ctx, hq)
    mask = torch.ones(rows, ctx, dtype=torch.bool).tril_(first)
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                                                  attn_mask=mask, scale=d ** -0.5)[0].transpose(0, 1)
    assert ((got.float() - torch_bf16.float()).abs().max() / torch_bf16.float().abs().max()).item() < 2 ** -7


@pytest.mark.parametrize("rows", [2, attention.KERNEL_CHUNK_ROWS + 9])
def test_paged_attention_routes_chunks_of_more_than_one_row_here(ops, rows) -> None:
    """A prefill chunk of two rows or more: its rows are this kernel's bits."""
    first, hq, hk, d = 40, 9, 3, 64
    q, kc, vc, table = case(rows, first, hq, hk, d, seed=11)
    k = torch.randn(rows, hk, d)
    v = torch.randn(rows, hk, d)
    pos = torch.arange(first, first + rows)
    meta = AttentionMetadata(slot_mapping=table[pos // BS] * BS + pos % BS,
                             prefills=[PrefillChunk(0, rows, first + rows, table)])
    got = attention.paged_attention(q, k, v, kc, vc, meta, d ** -0.5)  # writes k / v into the cache first
    assert torch.equal(got, attend(ops, q, kc, vc, table, first, d ** -0.5))
    assert attention._prefill_kernel(ops, torch.float32, 64)
    assert not attention._prefill_kernel(ops, torch.float32, 40)  # not whole vectors: torch's path
    assert attention._prefill_kernel(ops, torch.bfloat16, 64)
    assert not attention._prefill_kernel(ops, torch.float16, 64)  # fp16 models keep torch's path


@pytest.mark.parametrize("bad, message", [
    (lambda q, kc, vc, t: (q, kc, vc, torch.tensor([0, 1, 999]), 0), "block id 999 out of range"),
    (lambda q, kc, vc, t: (q, kc, vc, t[:1], 0), "do not fit the table"),
    (lambda q, kc, vc, t: (q, kc, vc, t, -1), "negative"),
    (lambda q, kc, vc, t: (q.double(), kc, vc, t, 0), "got q Double"),
    (lambda q, kc, vc, t: (q.bfloat16(), kc, vc, t, 0), "q bfloat16 over bfloat16 caches"),
    (lambda q, kc, vc, t: (q, kc, vc.bfloat16(), t, 0), "share one dtype"),
    (lambda q, kc, vc, t: (q[..., :40].contiguous(), kc[..., :40].contiguous(), vc[..., :40].contiguous(), t, 0),
     "multiple of 16"),
])
def test_bad_input_is_refused_before_any_read(ops, bad, message) -> None:
    q, kc, vc, table = case(40, 0, 9, 3, 64)
    q, kc, vc, table, first = bad(q, kc, vc, table)
    with pytest.raises(RuntimeError, match=message):
        ops.prefill_attention(torch.empty_like(q), q, kc, vc, table, first, 0.125)
