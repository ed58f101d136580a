"""Sliding-window models free the KV blocks that slid out of the window (issue 34): the scheduler gives them
back as a sequence moves on (the block manager's free count), their block-table entries become FREED, and
the attention paths never read one (a FREED entry is an index error; a NaN-filled freed block leaves the output
equal to a plain reference). Models whose layers mix windows: the sliding-window layers' own pool and table
(engine.window_blocks) free, the full layers' keep every block, the pool is sized for the windows
(workers.kv_cache), and a prefix hit needs only the window's tail there."""

from __future__ import annotations

import pytest
import torch

from ascend_ops import attention, batch_invariant
from ascend_ops.attention import AttentionMetadata, PrefillChunk
from bus.sampling_params import SamplingParams
from engine.block_manager import FREED, BlockManager
from engine.request import Sequence
from engine.scheduler.policy import Scheduler
from engine.window_blocks import WindowBlocks
from workers.kv_cache import KVCache, split_window_pool, window_pool_blocks

pytestmark = pytest.mark.unit

BS, W = 4, 7


def _seq(sid: str, tokens: list[int], max_tokens: int = 64) -> Sequence:
    return Sequence(sid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [0])


def _run(sched: Scheduler, steps: int) -> list:
    plans = []
    for _ in range(steps):
        step = sched.schedule()
        if not step.seqs:
            break
        plans.append(step)
        sched.update(step, {s.seq_id: (5, -0.1, None) for s, n, c in zip(step.seqs, step.num_new, step.num_computed)
                            if c + n == s.num_tokens})
    return plans


def _run_async(sched: Scheduler, steps: int) -> None:
    """As under async scheduling: each step's results come back after the next plan is made."""
    pending = []
    for _ in range(steps):
        step = sched.schedule()
        if step.seqs:
            pending.append(step)
        if len(pending) == 2 or (pending and not step.seqs):
            done = pending.pop(0)
            sched.update(done, {s.seq_id: (5, -0.1, None) for s, n, c in
                                zip(done.seqs, done.num_new, done.num_computed) if c + n == s.num_tokens})
        if not step.seqs and not pending:
            return


def test_blocks_before_the_window_are_freed_as_it_moves_and_the_table_keeps_its_positions():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, window=W)
    a = _seq("a", list(range(1, 31)), max_tokens=40)
    sched.add(a)
    held = []
    for step in _run(sched, 200):
        i = step.seqs.index(a) if a in step.seqs else None
        if i is None:
            continue
        start = step.num_computed[i]
        table = step.seqs[i].block_table
        # every block a query of this step can see is held; every one before the window is FREED
        first = max(0, start - W + 1) // BS
        assert all(b != FREED for b in table[first:]), (start, table)
        assert all(b == FREED for b in table[:max(0, start - W + 1) // BS])
        held.append(64 - bm.num_free)
    assert max(held[3:]) <= (W + BS - 2) // BS + 2, held  # the window's blocks, plus the one being filled
    assert bm.num_free == 64  # all given back at the end (FREED entries are not freed twice)


def test_without_a_window_every_block_is_kept():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)  # window 0
    sched.add(_seq("a", list(range(1, 31)), max_tokens=20))
    _run(sched, 6)
    assert FREED not in sched.running[0].block_table


def _mixed(full: int, win: int, caching: bool = True, max_num_seqs: int = 4, budget: int = 16):
    bm = BlockManager(num_blocks=full, block_size=BS, enable_prefix_caching=caching,
                      windows=WindowBlocks(win, BS, W))
    return bm, Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256, window=W)


@pytest.mark.parametrize("caching", [True, False])
def test_mixed_windows_free_the_window_groups_blocks_and_keep_the_full_groups(caching):
    """gpt-oss / Gemma 3: the full-attention layers' table keeps every block; the sliding layers' own table
    gives back those before the window, so its pool holds about W / BS + 1 blocks per sequence."""
    bm, sched = _mixed(64, 64, caching)
    a = _seq("a", list(range(1, 31)), max_tokens=40)
    sched.add(a)
    held = []
    for step in _run(sched, 200):
        if a not in step.seqs:
            continue
        start = step.num_computed[step.seqs.index(a)]
        assert FREED not in a.block_table and len(a.block_table) == len(a.window_table)
        first = max(0, start - W + 1) // BS
        assert all(b != FREED for b in a.window_table[first:]), (start, a.window_table)
        held.append(64 - bm.windows.num_free)
    assert max(held[3:]) <= (W + BS - 2) // BS + 2, held
    assert bm.num_free == bm.windows.num_free == 64  # all given back at the end, FREED entries not twice


def test_a_pool_of_window_pool_blocks_never_preempts_the_running_sequences():
    """workers.kv_cache.window_pool_blocks: four sequences at a 16-token budget fit 24 window blocks, with
    prefix caching (only hashed blocks released) and with the next plan made before a step's results."""
    need = window_pool_blocks(W, BS, max_num_seqs=4, max_num_batched_tokens=16)
    assert need == 4 * (2 + 2) + 2 * 4
    bm, sched = _mixed(512, need)
    seqs = [_seq(f"s{i}", [i + 1] * (20 + 9 * i), max_tokens=60) for i in range(4)]
    for s in seqs:
        sched.add(s)
    _run_async(sched, 400)
    assert all(s.finish_reason == "length" and s.num_preemptions == 0 for s in seqs)


def test_a_mixed_prefix_hit_needs_every_full_block_and_only_the_windows_tail():
    bm, sched = _mixed(64, 64)
    prompt = list(range(1, 41))
    sched.add(_seq("a", prompt, max_tokens=3))
    _run(sched, 40)
    b = _seq("b", prompt + [99], max_tokens=1)
    assert bm.match_prefix(b, 0) == 40
    tail = max(0, 40 - W + 1) // BS  # the first block a query at position 40 sees
    assert b.window_table[:tail] == [FREED] * tail and FREED not in b.window_table[tail:] and b.num_released == tail
    assert all(bm.windows.hash_of[w] == h for w, h in zip(b.window_table[tail:], b.block_hashes[tail:]))
    hashes = list(b.block_hashes)
    bm.free_seq(b)
    assert bm.num_free == bm.windows.num_free == 64
    # the window group's copy of block 8 evicted (rewritten): the longest hit whose tail avoids it is 8 blocks
    bm.windows.hash_of[bm.windows.cached.pop(hashes[8])] = None
    d = _seq("d", prompt + [99], max_tokens=1)
    assert bm.match_prefix(d, 0) == 8 * BS and len(d.block_table) == len(d.window_table) == 8
    assert d.window_table[:(32 - W + 1) // BS] == [FREED] * ((32 - W + 1) // BS)
    bm.free_seq(d)
    # held_blocks names the window group's block b as -2 - b (the workers' copy_blocks numbering)
    e = _seq("e", [3] * 9, max_tokens=1)
    bm.allocate(e, 9)
    assert bm.held_blocks() == sorted(e.block_table) + [-2 - w for w in sorted(e.window_table)]


def test_the_window_pool_takes_what_the_windows_need_and_the_full_layers_the_rest():
    assert split_window_pool(64, num_layers=3, window_layers=2, window_need=24) == (144, 24)
    assert split_window_pool(64, num_layers=2, window_layers=1, window_need=24) == (104, 24)
    assert split_window_pool(64, num_layers=2, window_layers=1, window_need=500) == (64, 64)  # no saving


def test_a_grouped_kv_cache_gives_each_layer_its_groups_blocks_and_offloads_both():
    kv = KVCache(3, 2, 8, BS, 10, torch.float32, torch.device("cpu"), window_layers=(0, 2), window_blocks=4)
    assert kv.tensor.shape[:3] == (1, 2, 10) and kv.window_tensor.shape[:3] == (2, 2, 4)
    assert kv.views[1][0].data_ptr() == kv.tensor[0, 0].data_ptr()
    assert kv.views[2][1].data_ptr() == kv.window_tensor[1, 1].data_ptr()
    assert kv.nbytes == (10 + 2 * 4) * 2 * BS * 2 * 8 * 4
    kv.tensor.normal_()
    kv.window_tensor.normal_()
    want = kv.tensor[:, :, [3]].clone(), kv.window_tensor[:, :, [1]].clone()
    ids, kept = kv.copy_blocks([3, -2 - 1])  # full block 3, window block 1
    kv.release()
    kv.allocate()
    kv.put_blocks(ids, kept)
    assert torch.equal(kv.tensor[:, :, [3]], want[0]) and torch.equal(kv.window_tensor[:, :, [1]], want[1])
    assert not kv.tensor[:, :, 4:].any()


def test_a_prefix_hit_after_release_reuses_only_blocks_whose_content_is_unchanged():
    bm = BlockManager(num_blocks=12, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, window=W)
    prompt = list(range(1, 21))
    a = _seq("a", prompt, max_tokens=30)
    sched.add(a)
    _run(sched, 40)  # a finished; its early blocks were released mid-way and rewritten by its own tail
    # the prefix chain must not point at a block that now holds other tokens: whatever matches is intact
    b = _seq("b", prompt + [99], max_tokens=1)
    hit = bm.match_prefix(b, 0)
    for i in range(hit // BS):
        h = b.block_hashes[i]
        assert bm.hash_of[b.block_table[i]] == h
    bm.free_seq(b)
    # a released block keeps its hash until rewritten: with room to spare, the whole prompt hits
    bm2 = BlockManager(num_blocks=64, block_size=BS)
    s2 = Scheduler(bm2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, window=W)
    s2.add(_seq("a", prompt, max_tokens=30))
    _run(s2, 40)
    c = _seq("c", prompt + [99], max_tokens=1)
    assert bm2.match_prefix(c, 0) == 20


def _case(lens: list[int], chunk: int, dtype: torch.dtype, window: int, bs: int = 4, hq: int = 4, hk: int = 2,
          d: int = 16):
    """One step (decodes, and with `chunk` the last sequence's last `chunk` tokens as a prefill chunk) whose
    block tables point every block wholly before a row's window at `nan_block` (full of NaN)."""
    gen = torch.Generator().manual_seed(0)
    nblk = [(n + bs - 1) // bs for n in lens]
    total = sum(nblk) + 1
    k_cache = torch.randn(total, bs, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, bs, hk, d, generator=gen).to(dtype)
    nan_block = total - 1
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    real, freed, at = [], [], 0
    for n, m in zip(lens, nblk):
        t = torch.arange(at, at + m)
        at += m
        first_q = n - (chunk if chunk and n == lens[-1] else 1)  # the first query position of its rows
        gone = max(0, first_q - window + 1) // bs
        real.append(t)
        freed.append(torch.cat([torch.full((gone,), nan_block), t[gone:]]))
    decodes = len(lens) - (1 if chunk else 0)
    rows = decodes + chunk
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    k = torch.randn(rows, hk, d, generator=gen).to(dtype)
    v = torch.randn(rows, hk, d, generator=gen).to(dtype)
    slots = [real[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens[:decodes])]
    prefills = []
    if chunk:
        n = lens[-1]
        pos = torch.arange(n - chunk, n)
        slots += (real[-1][pos // bs] * bs + pos % bs).tolist()
        prefills.append(PrefillChunk(decodes, chunk, n, freed[-1]))
    dt = torch.zeros(decodes, max(nblk[:decodes], default=1), dtype=torch.int64)
    for i in range(decodes):
        dt[i, :nblk[i]] = freed[i]
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), num_decodes=decodes, decode_block_tables=dt,
                             decode_ctx_lens=torch.tensor(lens[:decodes]), decode_max_ctx=max(lens[:decodes]),
                             prefills=prefills)
    return q, k, v, k_cache, v_cache, meta, real


def _reference(q, k, v, k_cache, v_cache, real, lens, chunk, window, bs=4):
    """fp64, per row: softmax over the keys (p - window, p] of its sequence (this step's k/v written first)."""
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    hq, hk = q.shape[1], k_cache.shape[2]
    rows = []  # (sequence, position)
    decodes = len(lens) - (1 if chunk else 0)
    rows += [(i, n - 1) for i, n in enumerate(lens[:decodes])]
    if chunk:
        rows += [(len(lens) - 1, p) for p in range(lens[-1] - chunk, lens[-1])]
    for r, (i, p) in enumerate(rows):
        kc[real[i][p // bs], p % bs] = k[r].double()
        vc[real[i][p // bs], p % bs] = v[r].double()
    out = []
    for r, (i, p) in enumerate(rows):
        keys = torch.arange(max(0, p - window + 1), p + 1)
        kk = kc[real[i][keys // bs], keys % bs].repeat_interleave(hq // hk, dim=1)
        vv = vc[real[i][keys // bs], keys % bs].repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,thd->ht", q[r].double(), kk) * q.shape[2] ** -0.5
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), vv))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("chunk", [0, 3, 20])
@pytest.mark.parametrize("invariant", [False, True])
def test_attention_never_reads_a_block_before_the_window(dtype, tol, chunk, invariant):
    lens = [3, 7, 9, 30, 61, 40]
    q, k, v, kc, vc, meta, real = _case(lens, chunk, dtype, W)
    # the torch paths (the kernels' windows: tests/test_cpu_attention.py, test_cpu_prefill_attention.py); both
    # modes' choices are made once per process, and tests/conftest.py gives them back after the test
    attention.select("torch")
    batch_invariant._attention_choice[:] = ["torch"]
    fn = batch_invariant.paged_attention if invariant else attention.paged_attention
    got = fn(q, k, v, kc, vc, meta, q.shape[2] ** -0.5, W)
    want = _reference(q, k, v, kc, vc, real, lens, chunk, W)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() < tol


def test_under_async_scheduling_a_released_block_was_hashed_first():
    """The next plan is made before this step's hashes are committed: a chunk that fills blocks and moves the
    window past them releases them only once they are hashed, so the whole prompt stays findable."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, window=W)
    prompt = list(range(1, 41))
    a = _seq("a", prompt, max_tokens=3)
    sched.add(a)
    _run_async(sched, 8)
    assert a.finish_reason == "length"
    assert bm.match_prefix(_seq("b", prompt + [99]), 0) == 40
