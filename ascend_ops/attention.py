"""Paged attention over the block-structured KV cache.

Layout (one pair per layer):  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; or, for
multi-head latent attention (DeepSeek-V3's MLA), one plane per layer [num_blocks, block_size, 1, W] holding
each token's compressed latent and its rotary key (`latent_attention`).
A token's KV lives at slot = block_id * block_size + offset. The model runner flattens a step's tokens
into one [T, ...] batch ordered decodes first (one token each), then prefill chunks; AttentionMetadata
says where each part starts.

Implementations behind the one signature: on CPU (default mode) the decode rows go through the C++ row kernel
of ascend_ops/cpu_kernels.py, which reads each sequence's blocks in place, and prefill chunks of more than one row
through the chunk kernel (csrc/cpu_prefill_attention.cpp: fp32 and bf16 queries, head dims of whole 16-lane vectors,
AVX2 or AVX-512 builds), which also reads the blocks in place and gives a row the same bits however its prompt is
chunked; where that kernel does not apply, chunks of up to KERNEL_CHUNK_ROWS rows take the row kernel (a
chunk's row reads only the keys up to its own position) and longer ones the portable path.
Elsewhere, and where the kernels cannot be built, the portable path gathers the blocks into a contiguous
copy and runs torch SDPA (an NPU build swaps in torch_npu's paged-attention kernels).
ROLLBUS_CPU_ATTENTION=torch forces the portable path on CPU; `implementation()` names the one in use (each
worker reports it in /server_info).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ascend_ops import cpu_kernels

CPU_ATTENTION_ENV = "ROLLBUS_CPU_ATTENTION"
CPU_CHOICES = ("kernel", "torch")
# The query dtypes the kernel takes, each with the caches it reads: the model's own, or (--kv-cache-dtype)
# 16 bits under fp32.
KERNEL_CACHE_DTYPES = {torch.float32: (torch.float32, torch.bfloat16, torch.float16), torch.bfloat16: (torch.bfloat16,)}
# Where the chunk kernel does not apply, prefill chunks of up to this many rows go through the row kernel (a
# prefix-cache hit, a chunked prefill's tail): there one SDPA call on gathered blocks costs 3-7x the kernel (118
# against 16 us for 1 row at 120 tokens of context, 149 / 43 us for 4 rows). Longer chunks keep SDPA (a GEMM per
# chunk). The chunk kernel itself beats the row kernel from 2 rows on (2 threads, SmolLM2's heads: 2 rows after
# 500 keys 28 against 39 us, 16 rows 81 against 181 us, 32 rows after 1,500 keys 405 against 1,498 us).
KERNEL_CHUNK_ROWS = 16
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_cpu_choice: list[str] = []  # the CPU implementation chosen (once, from the environment, or by select())


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # first row of this chunk in the flattened batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens of context after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every token computed this step
    num_decodes: int = 0  # rows [0, num_decodes) are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64 (0-padded)
    decode_ctx_lens: torch.Tensor | None = None  # [num_decodes] int64, context incl. the new token
    decode_max_ctx: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # hybrid models (workers/models/qwen3_next.py): each sequence's recurrent-state slot, decodes then prefill
    # chunks in their order ([num_decodes + len(prefills)] int64); None for attention-only models
    state_slots: torch.Tensor | None = None
    # a model whose attention layers mix windows (engine.window_blocks): the same step over the sliding-window
    # layers' own block tables and pool (for_layer); None where one table serves every layer
    window_group: AttentionMetadata | None = None

    def for_layer(self, window: int) -> AttentionMetadata:
        """The metadata a layer with this sliding window (0: full attention) reads its blocks by."""
        return self.window_group if window and self.window_group is not None else self


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter this step's k/v [T, Hk, D] into the caches at their slots (rounded to the caches' dtype where
    --kv-cache-dtype makes it narrower than the model's)."""
    nb, bs, hk, d = k_cache.shape
    k_cache.view(nb * bs, hk, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hk, d).index_copy_(0, slots, v.to(v_cache.dtype))


def select(choice: str | None = None) -> str:
    """The CPU attention in use, "kernel" or "torch": `choice` sets it (benchmarks compare both in one
    process), else ROLLBUS_CPU_ATTENTION decides once (default "kernel"; an unknown value is an error).
    "kernel" falls back to "torch", with one warning naming why, where the extension cannot be built."""
    if choice is None and _cpu_choice:
        return _cpu_choice[0]
    want = choice if choice is not None else (os.environ.get(CPU_ATTENTION_ENV) or "kernel")
    if want not in CPU_CHOICES:
        raise ValueError(f"{CPU_ATTENTION_ENV} must be one of {', '.join(CPU_CHOICES)}, got {want!r}")
    if want == "kernel" and cpu_kernels.ops() is None:
        want = "torch"
    _cpu_choice[:] = [want]
    return want


def implementation(device_type: str, q_dtype: torch.dtype | None = None, cache_dtype: torch.dtype | None = None) -> str:
    """What paged_attention runs on this device type (for these query and KV-cache dtypes, where given):
    "cpu_paged_kernel" (in place, C++) or "torch_sdpa" (blocks gathered, then SDPA)."""
    reads = q_dtype is None or kernel_reads(q_dtype, q_dtype if cache_dtype is None else cache_dtype)
    return "cpu_paged_kernel" if device_type == "cpu" and reads and select() == "kernel" else "torch_sdpa"


def kernel_reads(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the CPU kernel takes queries of q_dtype over caches of cache_dtype (else the portable path)."""
    return cache_dtype in KERNEL_CACHE_DTYPES.get(q_dtype, ())


def _prefill_kernel(kern, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the chunk kernel (ascend_ops/csrc/cpu_prefill_attention.cpp) takes this layer's prefill chunks:
    fp32 or bf16 queries (over the caches the row kernel reads for them), a head dimension of whole 16-lane
    vectors, and a build with AVX2 or AVX-512."""
    return dtype in KERNEL_CACHE_DTYPES and head_dim % 16 == 0 and _prefill_width(kern) > 0


@functools.cache
def _prefill_width(kern) -> int:
    return int(kern.prefill_attention_width())


def _cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor):
    if q.device.type != "cpu" or not kernel_reads(q.dtype, k_cache.dtype) or select() != "kernel":
        return None
    return cpu_kernels.ops()


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D] (this step's keys, rope applied)
    v: torch.Tensor,  # [T, Hk, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Attention output [T, Hq, D]. Writes k/v into the cache first, then reads context from it (blocks of a
    --kv-cache-dtype narrower than q's are widened to it: `.to` is a no-op where they match).
    `window` > 0: sliding-window attention as HF masks it, a query at position p sees the keys at positions
    (p - window, p]; both kernels read only those."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nb, bs, hk, d = k_cache.shape
    gqa = q.shape[1] != hk
    kern = _cpu_kernel(q, k_cache)
    if meta.num_decodes and kern is not None:
        n = meta.num_decodes
        kern.paged_attention_rows(out[:n], q[:n], k_cache, v_cache, meta.decode_block_tables, _NO_ROWS,
                                  meta.decode_ctx_lens.contiguous(), scale, window)  # type: ignore[union-attr]
    elif meta.num_decodes:
        n = meta.num_decodes
        nblk = (meta.decode_max_ctx + bs - 1) // bs
        tables = meta.decode_block_tables[:, :nblk]  # type: ignore[index]
        lens = meta.decode_ctx_lens[:, None]  # type: ignore[index]
        pos = torch.arange(nblk * bs, device=q.device)[None, :]
        if window:  # only the blocks the window covers: those before it may have been freed
            tables, pos = _window_columns(tables, lens, window, bs)
            nblk = tables.shape[1]
        # index_select copies whole blocks (memcpy rows); 2-D advanced indexing is ~3x slower on CPU.
        flat = tables.reshape(-1)
        kc = k_cache.index_select(0, flat).to(q.dtype).view(n, nblk * bs, hk, d).transpose(1, 2)  # [n,Hk,L,D]
        vc = v_cache.index_select(0, flat).to(q.dtype).view(n, nblk * bs, hk, d).transpose(1, 2)
        mask = pos < lens
        if window:
            mask &= pos >= lens - window
        mask = mask.view(n, 1, 1, -1)
        qd = q[:n].unsqueeze(2)  # [n, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[:n] = o.squeeze(2)
    chunks = kern is not None and _prefill_kernel(kern, q.dtype, d)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        if chunks and c.q_len > 1:  # the same causal attention, in place over the blocks
            kern.prefill_attention(out[rows], q[rows], k_cache, v_cache, c.block_table,  # type: ignore[union-attr]
                                   c.ctx_len - c.q_len, scale, window)
            continue
        if kern is not None and c.q_len <= KERNEL_CHUNK_ROWS:  # row i sees ctx_len - q_len + i + 1 keys
            kern.paged_attention_rows(out[rows], q[rows], k_cache, v_cache, c.block_table.view(1, -1),
                                      torch.zeros(c.q_len, dtype=torch.int64),
                                      torch.arange(c.ctx_len - c.q_len + 1, c.ctx_len + 1), scale, window)
            continue
        # a windowed layer reads from the block of its first row's first key on (those before may be freed);
        # positions below are relative to that block's start, which keeps their differences
        skip = max(0, c.ctx_len - c.q_len - window + 1) // bs if window else 0
        table, ctx = c.block_table[skip:], c.ctx_len - skip * bs
        kc = k_cache.index_select(0, table).to(q.dtype).view(-1, hk, d)[:ctx].transpose(0, 1)
        vc = v_cache.index_select(0, table).to(q.dtype).view(-1, hk, d)[:ctx].transpose(0, 1)
        qc = q[c.q_start : c.q_start + c.q_len].transpose(0, 1)  # [Hq, q_len, D]
        if q.dtype == torch.float32 and q.device.type == "cpu":
            o = _causal_slices(qc, kc, vc, ctx, scale, window) if window else _causal_flash(qc, kc, vc, scale)
            out[c.q_start : c.q_start + c.q_len] = o.transpose(0, 1)
            continue
        # Row i (position ctx - q_len + i) sees keys at positions <= its own.
        qpos = torch.arange(ctx - c.q_len, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)[None, :]
        mask = kpos <= qpos[:, None]
        if window:
            mask &= kpos > qpos[:, None] - window
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[c.q_start : c.q_start + c.q_len] = o.transpose(0, 1)
    return out


def _window_columns(tables: torch.Tensor, lens: torch.Tensor, window: int, bs: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows of a sliding-window layer: each row's block-table columns from the block of its first visible
    key (position lens - window) on, as many as a window can span (past the table's end: its last column,
    whose positions the mask hides), and the key position of every gathered slot [n, columns * bs]."""
    width = tables.shape[1]
    span = min(width, (window + bs - 2) // bs + 1)
    first = (lens - window).clamp(min=0) // bs  # [n, 1]
    cols = first + torch.arange(span, device=tables.device)[None, :]
    pos = (cols * bs)[:, :, None] + torch.arange(bs, device=tables.device)
    return tables.gather(1, cols.clamp(max=width - 1)), pos.view(cols.shape[0], -1)


def _causal_flash(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill's queries [Hq, q_len, D] (the last q_len positions) over its keys / values
    [Hk, ctx_len, D] by torch's CPU flash attention, which skips the blocks above the diagonal: is_causal for a
    whole prompt, the lower-right causal bias for a chunk after earlier context. The KV heads are repeated per
    query group first (a contiguous copy of one sequence's keys: 1.5 MB for SmolLM2 at 2,048 tokens), which
    runs ~1.25x faster than SDPA's enable_gqa. For a 2,048-token SmolLM2 prompt this takes 0.42x the time of
    _causal_slices (one thread on a loaded host: 108 against 254 ms a layer)."""
    g = qc.shape[0] // kc.shape[0]
    if g > 1:
        kc, vc = kc.repeat_interleave(g, 0), vc.repeat_interleave(g, 0)
    q_len, ctx_len = qc.shape[1], kc.shape[1]
    if SPLIT_CHUNK_ROWS <= q_len < ctx_len and _flash_lse is not None:
        return _after_context(qc, kc, vc, scale)
    # A chunk after earlier context: the lower-right causal mask as a boolean tensor, which is what
    # torch.nn.attention.bias.causal_lower_right becomes on CPU (SDPA's result is the same bit for bit). That
    # module imports torch._dynamo: 0.7-1.6 s, paid by the first prompt that hit the prefix cache, mid-serving.
    mask = None if q_len == ctx_len else torch.ones(q_len, ctx_len, dtype=torch.bool).tril_(ctx_len - q_len)
    return F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale)[0]


# A chunk of at least this many rows after earlier context attends in two parts (_after_context): with the mask,
# torch's CPU flash attention computes every block of the chunk's own square and adds the mask to each score (one
# thread, SmolLM2's heads, calls interleaved on a loaded host: 2,048 rows after 2,048 cached keys 1,093 ms masked
# against 591 split, 52 against ~90 M scores/s, where a fresh 2,048-token prompt runs at 83; 1,024 after 1,024: 216
# against 185 ms; 512 rows after 1,536: 106 against 114 ms, so shorter chunks keep the mask).
SPLIT_CHUNK_ROWS = 1024
# torch's CPU flash attention returning each row's log-sum-exp beside its output (None where this torch lacks it)
_flash_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _after_context(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float) -> torch.Tensor:
    """_causal_flash's chunk after earlier context ([Hq, q_len, D] queries, the KV heads already repeated to Hq):
    the earlier keys, which every row sees, unmasked, and the chunk's own keys causal (blocks above the diagonal
    skipped), the two outputs merged by their rows' log-sum-exps. The same attention, summed in another order."""
    first = kc.shape[1] - qc.shape[1]
    o1, l1 = _flash_lse(qc[None], kc[None, :, :first], vc[None, :, :first], 0.0, False, scale=scale)
    o2, l2 = _flash_lse(qc[None], kc[None, :, first:], vc[None, :, first:], 0.0, True, scale=scale)
    w2 = torch.sigmoid(l2 - l1)[0, ..., None]  # exp(l2) / (exp(l1) + exp(l2)), the chunk's share of each row
    return torch.lerp(o1[0], o2[0], w2)


PREFILL_SLICE_ROWS = 128  # query rows per slice of a long prefill with a sliding window (_causal_slices)


def _causal_slices(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ctx_len: int, scale: float,
                   window: int) -> torch.Tensor:
    """Causal attention of a prefill's queries [Hq, q_len, D] (the last q_len of ctx_len positions) over its
    keys / values [Hk, ctx_len, D], in slices of PREFILL_SLICE_ROWS query rows: each slice multiplies only the
    keys up to its last row (and from its first row's window), as two batched GEMMs per KV head group. On CPU in
    fp32 this runs ~5x faster than torch's SDPA with a mask for a 2,048-token prompt (SDPA's CPU path computes
    every masked score). The same attention, the sums in another order."""
    hq, q_len, d = qc.shape
    hk = kc.shape[0]
    g = hq // hk
    qg = qc.reshape(hk, g, q_len, d)
    out = torch.empty(hk, g, q_len, d, dtype=qc.dtype, device=qc.device)
    first = ctx_len - q_len  # absolute position of query row 0
    for a in range(0, q_len, PREFILL_SLICE_ROWS):
        b = min(a + PREFILL_SLICE_ROWS, q_len)
        hi = first + b  # keys [lo, hi) cover every row of the slice
        lo = max(0, first + a - window + 1) if window else 0
        scores = torch.matmul(qg[:, :, a:b], kc[:, None, lo:hi].transpose(-1, -2)).mul_(scale)  # [Hk, g, rows, keys]
        qpos = torch.arange(first + a, first + b, device=qc.device)[:, None]
        kpos = torch.arange(lo, hi, device=qc.device)[None, :]
        hidden = kpos > qpos
        if window:
            hidden |= kpos <= qpos - window
        scores.masked_fill_(hidden, float("-inf"))
        out[:, :, a:b] = torch.matmul(torch.softmax(scores, dim=-1), vc[:, None, lo:hi])
    return out.view(hq, q_len, d)


def latent_attention(
    attend,  # a paged_attention (this module's, or ascend_ops.batch_invariant's)
    q: torch.Tensor,  # [T, H, W]: each head's query absorbed into the latent space, then its rotary part
    latent: torch.Tensor,  # [T, 1, W]: this step's tokens' [compressed kv ; rotary key]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, W]: the layer's one plane
    meta: AttentionMetadata,
    scale: float,
    v_dim: int,  # the values are the first v_dim entries of each cached row (the compressed kv)
) -> torch.Tensor:
    """MLA attention, absorbed as vLLM's MLA backends compute it: multi-query attention with one KV head
    whose keys are the cached rows and whose values are the same rows' leading v_dim entries. Returns [T, H,
    v_dim]. The plane is passed as both caches, so the kernels that take [T, Hq, D] queries over K and V of
    one width run unchanged (the W - v_dim trailing outputs, a weighted sum of rotary keys, are dropped)."""
    return attend(q, latent, latent, cache, cache, meta, scale)[..., :v_dim]
