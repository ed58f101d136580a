"""Batch-invariant kernels: a row's result never depends on the other rows in the step.

Selected once, when the model is built, by `kernels(batch_invariant=True)`; the default kernels
(ascend_ops.ops, ascend_ops.attention) are untouched and cost nothing extra. Every op a decoder step
goes through has exactly one implementation in each set (`Kernels`).

What makes each op invariant (measured on CPU; `self_check`, ascend_ops.batch_invariant_check, re-measures on the
device at start-up):
- linear (and the LM head, the router, the experts): a GEMM library picks its kernel, and with it the
  order of the reduction over K, from the number of rows M, and how it picks differs between CPUs. MKL's
  sgemm (torch's F.linear on CPU) on an AMD Zen 4 used a different order for M = 1, for M = 2-3 and for
  the tail rows of some M below 12, then one order for every multiple of 4 rows measured (4 .. 4096); on
  an Intel Xeon with AVX-512 and AMX it changed order again at M = 13 for K = 576, and at M = 5 for K =
  160. oneDNN's brgemm (a packed product of ascend_ops.packed_linear, and the same primitive on a plain
  weight) kept one order for every row of every M measured (4 .. 300) in fp32, and so did MKL's packed
  sgemm (the other packed product, fp32 on Intel CPUs); in bf16 on the Xeon (AMX) some rows of oneDNN
  products of more than 32 rows took another order, and none of 4 .. 32 rows. So on CPU a parameter
  multiplies on default mode's packed copy and any other fp32 / bf16 weight (an expert's slice) on
  oneDNN's primitive as it is, rows padded to a multiple of ROW_MULTIPLE (at most 3 zero rows), bf16 in
  pieces of BF16_ROWS rows (a bf16 step of 64 rows reads each weight twice);
  `self_check` measures each of the model's products at start-up and refuses where one is not invariant.
  Elsewhere F.linear, padded the same way.
- attention over the paged cache: every query row (a decode or any row of a prefill chunk, of any length) is
  computed alone from its own q and its own context, the keys and values up to its position read in position
  order (from its window's first key in a sliding-window layer). On CPU (fp32 / bf16, where
  ascend_ops.cpu_kernels builds) that is the C++ kernel the default mode runs for decodes,
  torch.ops.rollbus_cpu.paged_attention_rows, given each row's block table and context length: it computes one
  (row, KV head) at a time with a fixed sequence of operations (fp32 dots, a two-pass softmax, the weighted sum
  of V), and how the rows are split among threads never changes a row's arithmetic. Elsewhere
  (ROLLBUS_CPU_ATTENTION=torch, no compiler, another device) a torch path: the scores of a row's G query heads
  that share a KV head against one KV-cache block of keys are one [G, D] x [D, block_size] GEMM (a fixed shape,
  so a fixed reduction order), the block's softmax numerators and its [G, block] x [block, D] product likewise;
  the blocks are then combined by a pairwise tree over the row's blocks, padded with exact zeros to a power of
  two, so how many blocks other rows have changes nothing. Which of the two runs is decided once per process
  (`attention_backend`), for the engine and the trainer side (engine.trainer) alike. Both compute in fp32
  whatever the model dtype. Hence a position gives the same bits computed in a decode or in a prefill chunk of
  any size, alone or in any batch, from the prefix cache or recomputed.
- SiLU (and with it SiLU*mul, in the dense MLPs and in every expert): torch's CPU elementwise loops run
  the vectorised kernel over whole vectors and the scalar one over each loop's tail, and a tensor of
  32768 elements or more is split between threads at an element index, i.e. in the middle of some row.
  For F.silu the two kernels differ (4% of fp32 inputs, in the last bit), so the row that straddles the
  split gets other bits than alone (measured: row 102 of a [205, 160] SiLU*mul on 2 threads; in a
  serving step of 309 rows the row of a request's prefill, whose changed KV then moved one of its
  logprobs by 1 ulp). Here SiLU is x / (1 + exp(-x)) in fp32: neg, add and div are IEEE-exact in both
  kernels, and exp's vectorised and scalar kernels agree (`self_check` re-measures all this with the
  model's sizes and a row count that puts a thread split inside a row). Its backward is SiLU's usual
  derivative (the trainer's gradients need float agreement, not bits).
- GELU (tanh; Gemma 3's MLP), gpt-oss's clamped SwiGLU and the tanh of Gemma 3's logit soft-cap: the same
  hazard (F.gelu's and torch.sigmoid's two kernels differ too), the same cure: written with exp and exact
  arithmetic in fp32, rounded once (ascend_ops.invariant_activations); `self_check` measures the model's.
- gpt-oss's experts, stored [E, K, N]: their products run on a contiguous [E, N, K] copy (`experts_nk`, kept
  like a packed weight), and the sink attention takes the invariant attention in both modes (the row kernel
  adds each head's sink to its denominator).
- RMSNorm, rotary, the router's softmax/top-k, log_softmax over the vocabulary, the expert sums (each
  token sums its own k products in slot order) and the sampler's per-row filters and draws are row-wise
  in torch already (exact arithmetic, or per-row reduction kernels); they are the default
  implementations, and `self_check` verifies them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascend_ops import attention as _attention
from ascend_ops import cpu_kernels
from ascend_ops import invariant_activations as _act
from ascend_ops import ops as _ops
from ascend_ops import packed_linear as _packed
from ascend_ops.attention import AttentionMetadata, write_kv

ROW_MULTIPLE = 4  # linear: rows padded to a multiple of this (see the module docstring)
BF16_ROWS = 32  # linear, bf16 on oneDNN: at most this many rows per product (a multiple of ROW_MULTIPLE)
TORCH_GRAIN = 32768  # at::internal::GRAIN_SIZE: CPU elementwise ops of this many elements or more are split
PAIR_BUDGET = 4096  # attention (torch path): (query row, key block) pairs computed at once; bounds the gathered K/V
_NO_ROWS = torch.empty(0, dtype=torch.int64)
_attention_choice: list[str] = []  # "kernel" or "torch", decided on first use (attention_backend)


@dataclass(frozen=True, slots=True)
class Kernels:
    """The ops a decoder step goes through; one implementation of each per mode."""

    name: str
    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    silu_and_mul: Callable[..., torch.Tensor]
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    moe_experts: Callable[..., torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]
    # (x + h, rms_norm(x + h)) in one pass (default mode); None: the layer adds, then calls rms_norm
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    head_linear: Callable[..., torch.Tensor] = _ops.head_linear  # per-head products (MLA's absorbed projections)
    gelu_tanh_and_mul: Callable[..., torch.Tensor] = _ops.gelu_tanh_and_mul  # Gemma 3's MLP
    clamped_swiglu: Callable[..., torch.Tensor] = _ops.clamped_swiglu  # gpt-oss's experts
    tanh: Callable[..., torch.Tensor] = torch.tanh  # Gemma 3's final logit soft-cap
    # stacked experts stored [E, K, N] (gpt-oss's) as [E, N, K] for `linear`: a view, or a cached copy
    experts_nk: Callable[[torch.Tensor], torch.Tensor] = lambda w: w.transpose(1, 2)

    def latent_attention(self, q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
        """Multi-head latent attention over one cache plane per layer (ascend_ops.attention.latent_attention),
        through this mode's paged attention."""
        return _attention.latent_attention(self.paged_attention, q, latent, cache, meta, scale, v_dim)

    @property
    def batch_invariant(self) -> bool:
        return self.name == "batch_invariant"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear whose row i depends only on row i: x [M, K] padded to a multiple of ROW_MULTIPLE rows.

    A CPU parameter multiplies on its pre-packed copy (ascend_ops.packed_linear), as in default mode:
    that product is row-invariant for M >= ROW_MULTIPLE, as F.linear is, and `self_check` measures both on
    the model's own parameters at start-up. With autograd (the trainer side, engine.trainer) the forward
    is the same packed product, so its bits are the engine's, and the backward is F.linear's."""
    m = x.shape[0]
    pad = (-m) % ROW_MULTIPLE
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    if not (xp.dim() == 2 and (_packed.packable(xp, weight) or _packed.cpu_operands(xp, weight))):
        out = F.linear(xp, weight, bias)
    elif torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                      or (bias is not None and bias.requires_grad)):
        out = _PackedLinear.apply(xp, weight, bias)
    else:
        out = _cpu_product(xp, weight, bias)
    return out[:m] if pad else out


def _cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and x.shape[0] > BF16_ROWS and not (_packed.packable(x, weight)
                                                                     and _packed.row_invariant(weight)):
        # bf16 on oneDNN: pieces of BF16_ROWS rows (docstring); a panel kernel is row-invariant at any rows
        return torch.cat([_cpu_product(x[i:i + BF16_ROWS], weight, bias) for i in range(0, x.shape[0], BF16_ROWS)])
    if _packed.packable(x, weight):  # a parameter: on its packed copy, default mode's (MKL's or oneDNN's)
        return _packed.product(x, weight, bias)
    # any other weight (an expert's slice of a stacked parameter): the same primitive on the plain layout,
    # reordered inside oneDNN for this call (about F.linear's cost; packing it here would cost more)
    return torch.ops.mkldnn._linear_pointwise(x, weight.detach().contiguous(), bias, "none", [], "")


class _PackedLinear(torch.autograd.Function):
    """The CPU library's product forward; F.linear's gradients backward (within float tolerance of HF's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _cpu_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.transpose(0, 1) @ x if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _Silu(torch.autograd.Function):
    """x * sigmoid(x) as x / (1 + exp(-x)) in fp32, rounded once to x's dtype (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _silu_value(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        xf = x.float()
        s = torch.sigmoid(xf)  # not exp(-x): that overflows to inf (and a NaN gradient) below x = -88
        return (grad.float() * s * (1 + xf * (1 - s))).to(grad.dtype)


def _silu_value(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in fp32, rounded once to x's dtype: one buffer, the ops in place (the same bits as
    the expression written out, without three temporaries)."""
    xf = x.float()
    e = torch.neg(xf)
    e.exp_()
    e.add_(1)
    return torch.div(xf, e, out=e).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu whose every element gets the same bits wherever it sits in the tensor (module docstring)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Silu.apply(x)
    return _silu_value(x)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return silu(gate) * up
    return silu(gate).mul_(up)  # silu's result is a fresh tensor of gate's dtype: the product lands in it


def moe_experts(x, expert_ids, expert_weights, gate_up, down, lora=None) -> torch.Tensor:
    """ops.moe_experts with the invariant linear and SiLU: each expert's GEMMs see however many tokens chose it."""
    return _ops.moe_experts(x, expert_ids, expert_weights, gate_up, down, mm=linear, act=silu_and_mul, lora=lora)


def experts_nk(w: torch.Tensor) -> torch.Tensor:
    """Stacked experts stored [E, K, N] (gpt-oss's, HF's layout) as [E, N, K] for `linear`. On CPU a contiguous
    copy, made once per weight version and kept on the parameter where ascend_ops.packed_linear keeps its
    packed copies (so `forget`, which the worker calls after every weight change, sleep and wake, drops it):
    oneDNN's product on a transposed view reorders it on every call, measured 1.4x torch's matmul per gpt-oss-20b
    expert GEMM at 32 rows (1 thread), against 0.8x on the contiguous copy. It costs a second copy of the
    experts' bytes (packed_bytes counts it)."""
    if w.device.type != "cpu":
        return w.transpose(1, 2)
    key = (w.data_ptr(), w._version, "experts_nk")
    entry = getattr(w, _packed._ATTR, None)
    if entry is None or entry[0] != key:
        entry = (key, w.detach().transpose(1, 2).contiguous())
        setattr(w, _packed._ATTR, entry)
    return entry[1]


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ops.head_linear one head at a time through the row-invariant linear (a batched GEMM's reduction order
    may depend on the row count)."""
    return torch.stack([linear(x[:, h].contiguous(), w[h]) for h in range(w.shape[0])], dim=1)


def _row_tables(meta: AttentionMetadata, num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its block table [T, W] (0-padded) and its context length [T] (its position + 1)."""
    widths = [c.block_table.shape[0] for c in meta.prefills]
    if meta.num_decodes:
        widths.append(meta.decode_block_tables.shape[1])  # type: ignore[union-attr]
    tables = torch.zeros(num_rows, max(widths), dtype=torch.int64, device=device)
    lens = torch.empty(num_rows, dtype=torch.int64, device=device)
    if meta.num_decodes:
        n = meta.num_decodes
        tables[:n, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables  # type: ignore[union-attr]
        lens[:n] = meta.decode_ctx_lens  # type: ignore[assignment]
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        tables[rows, : c.block_table.shape[0]] = c.block_table
        lens[rows] = torch.arange(c.ctx_len - c.q_len + 1, c.ctx_len + 1, device=device)
    return tables, lens


def attention_backend() -> str:
    """The invariant attention of this process: "kernel" (the CPU kernel, where ascend_ops.attention.select()
    chose it: ROLLBUS_CPU_ATTENTION unset or "kernel", and the extension builds) or "torch". Decided on the
    first call and kept: a later ascend_ops.attention.select("torch") (a benchmark's) changes default mode
    only, so the engine's and the trainer side's bits in one process never come from two implementations."""
    if not _attention_choice:
        _attention_choice.append(_attention.select())
    return _attention_choice[0]


def attention_implementation(device_type: str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> str:
    """What invariant paged attention runs for this device, model dtype and KV-cache dtype (default: the
    model's); each worker reports it in /server_info."""
    reads = _attention.kernel_reads(dtype, dtype if cache_dtype is None else cache_dtype)
    kernel = device_type == "cpu" and reads and attention_backend() == "kernel"
    return "batch_invariant_cpu_kernel" if kernel else "batch_invariant_torch"


def attention_kernel(q: torch.Tensor, k_cache: torch.Tensor):
    """torch.ops.rollbus_cpu where the invariant attention runs the CPU kernel for these tensors, else None."""
    if attention_implementation(q.device.type, q.dtype, k_cache.dtype) != "batch_invariant_cpu_kernel":
        return None
    return cpu_kernels.ops()


# (meta, tables, row_table, row_len) of the last step's metadata objects: its layers share them (two: a
# mixed-window model's sliding layers read their own group's, AttentionMetadata.for_layer)
_step_rows: list = []


def _kernel_rows(meta: AttentionMetadata, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's view of a step: one block table per decode and per prefill chunk ([N, W], 0-padded),
    each row's table (row_table [T]) and context length (row_len [T]: its position + 1). Built once per
    step (the metadata object), not once per layer."""
    for entry in _step_rows:
        if entry[0] is meta:
            return entry[1], entry[2], entry[3]
    n = meta.num_decodes
    widths = [c.block_table.shape[0] for c in meta.prefills] + ([meta.decode_block_tables.shape[1]] if n else [])
    tables = torch.zeros(n + len(meta.prefills), max(widths), dtype=torch.int64)
    row_table = torch.zeros(num_rows, dtype=torch.int64)
    row_len = torch.zeros(num_rows, dtype=torch.int64)  # a row no part covers (none should) gets zeros
    if n:
        tables[:n, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables  # type: ignore[union-attr]
        row_table[:n] = torch.arange(n)
        row_len[:n] = meta.decode_ctx_lens  # type: ignore[assignment]
    for i, c in enumerate(meta.prefills):
        rows = slice(c.q_start, c.q_start + c.q_len)
        tables[n + i, : c.block_table.shape[0]] = c.block_table
        row_table[rows] = n + i
        row_len[rows] = torch.arange(c.ctx_len - c.q_len + 1, c.ctx_len + 1)
    _step_rows[:] = [*_step_rows[-1:], (meta, tables, row_table, row_len)]
    return tables, row_table, row_len


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Same contract as ascend_ops.attention.paged_attention; each row computed alone (module docstring), a
    sliding-window layer's (`window` > 0) over its last `window` keys only (the kernel reads no block before)."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return _rows_attention(q, k_cache, v_cache, meta, scale, window)


def sink_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Paged attention with attention sinks (gpt-oss): each query head's softmax has one more logit, sinks[h],
    in its denominator and nothing in its numerator. In both modes every row alone: the row kernel where the
    invariant attention runs it, else the torch path below."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return _rows_attention(q, k_cache, v_cache, meta, scale, window, sinks)


def _rows_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of the step through the row kernel, each with its own context (a decode-only step: the call
    default mode makes), or the torch path where the kernel does not run."""
    kern = attention_kernel(q, k_cache)
    if kern is None:
        return _paged_attention_torch(q, k_cache, v_cache, meta, scale, window, sinks)
    out = torch.empty_like(q)
    sk = None if sinks is None else sinks.detach().float().contiguous()
    if not meta.prefills:
        kern.paged_attention_rows(out, q, k_cache, v_cache, meta.decode_block_tables, _NO_ROWS,
                                  meta.decode_ctx_lens.contiguous(), scale, window, sk)  # type: ignore[union-attr]
    else:
        tables, row_table, row_len = _kernel_rows(meta, q.shape[0])
        kern.paged_attention_rows(out, q, k_cache, v_cache, tables, row_table, row_len, scale, window, sk)
    return out


def _paged_attention_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The portable path (module docstring): rows in chunks of at most PAIR_BUDGET (row, block) pairs."""
    T = q.shape[0]
    bs = k_cache.shape[1]
    tables, lens = _row_tables(meta, T, q.device)
    nblk = (lens + bs - 1) // bs
    out = torch.empty_like(q)
    rows_per_chunk = max(1, PAIR_BUDGET // int(nblk.max()))
    for r0 in range(0, T, rows_per_chunk):
        r1 = min(T, r0 + rows_per_chunk)
        out[r0:r1] = _attend_rows(q[r0:r1], tables[r0:r1], lens[r0:r1], nblk[r0:r1], k_cache, v_cache, scale,
                                  window, sinks)
    return out


def _attend_rows(q, tables, lens, nblk, k_cache, v_cache, scale, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    R, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    g = hq // hk
    nb = int(nblk.max())
    dev = q.device
    valid = torch.arange(nb, device=dev)[None, :] < nblk[:, None]  # [R, nb]
    if window:  # not the blocks wholly before the window (they may have been freed; all their terms are 0)
        valid &= torch.arange(nb, device=dev)[None, :] >= ((lens - window).clamp(min=0) // bs)[:, None]
    row, blk = valid.nonzero(as_tuple=True)  # the (row, block) pairs, P of them
    P = row.shape[0]
    ids = tables[row, blk]
    # gathered straight into [P, Hk, bs, D] (one copy), so each (pair, KV head) is a contiguous [bs, D] matrix
    kb = k_cache.transpose(1, 2).index_select(0, ids).float().view(P * hk, bs, d)
    vb = v_cache.transpose(1, 2).index_select(0, ids).float().view(P * hk, bs, d)
    qp = q.float()[row].view(P * hk, g, d)  # the G query heads of each KV head
    s = torch.bmm(qp, kb.transpose(1, 2)).view(P, hk, g, bs) * scale
    keypos = blk[:, None] * bs + torch.arange(bs, device=dev)[None, :]  # [P, bs]
    hidden = keypos >= lens[row][:, None]
    if window:  # keys before the window: masked like those after the row (a block may be all masked: p = 0)
        hidden |= keypos < (lens[row] - window)[:, None]
    s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
    # the row's max over all its keys (a max is exact in any order); softmax numerators against it
    rowmax = torch.full((R, hk * g), float("-inf"), device=dev).scatter_reduce(
        0, row[:, None].expand(P, hk * g), s.detach().amax(dim=-1).view(P, hk * g), "amax")
    if sinks is not None:  # the sink logit takes part in the max, as HF subtracts it
        rowmax = torch.maximum(rowmax, sinks.float()[None, :])
    p = torch.exp(s - rowmax[row].view(P, hk, g, 1))  # [P, Hk, G, bs]
    lsum = p.sum(dim=-1).view(P, hq)  # per block: a fixed-length sum
    o = torch.bmm(p.view(P * hk, g, bs), vb).view(P, hq, d)
    width = 1 << max(0, nb - 1).bit_length()  # blocks padded with exact zeros to a power of two
    L = torch.zeros(R, width, hq, device=dev)
    out = torch.zeros(R, width, hq, d, device=dev)
    L[row, blk] = lsum
    out[row, blk] = o
    while width > 1:  # pairwise tree: the same additions whatever the padding
        L = L[:, 0::2] + L[:, 1::2]
        out = out[:, 0::2] + out[:, 1::2]
        width //= 2
    denom = L[:, 0] if sinks is None else L[:, 0] + torch.exp(sinks.float()[None, :] - rowmax)
    return (out[:, 0] / denom[:, :, None]).to(q.dtype)


DEFAULT = Kernels("default", _packed.linear, _ops.fused_rms_norm, _ops.fused_silu_and_mul, _ops.fused_apply_rope,
                  _ops.moe_route, functools.partial(_ops.moe_experts, grouped=_packed.grouped_linear),
                  _attention.paged_attention, _ops.fused_add_rms_norm)
INVARIANT = Kernels("batch_invariant", linear, _ops.rms_norm, silu_and_mul, _ops.apply_rope, _ops.moe_route,
                    moe_experts, paged_attention, head_linear=head_linear, gelu_tanh_and_mul=_act.gelu_tanh_and_mul,
                    clamped_swiglu=_act.clamped_swiglu, tanh=_act.tanh, experts_nk=experts_nk)


def kernels(batch_invariant: bool) -> Kernels:
    return INVARIANT if batch_invariant else DEFAULT
