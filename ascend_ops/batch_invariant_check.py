"""The start-up self-check of the batch-invariant kernels (ascend_ops.batch_invariant, whose docstring says
what makes each op invariant): `self_check` measures, on the model's device and dtype and with its real
shapes, that each kernel the model runs gives every row the same bits whatever else is computed with it, and
raises BatchInvarianceUnavailable naming the first that does not (docs/batch-invariance.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import TORCH_GRAIN, Kernels, attention_implementation, sink_attention


class BatchInvarianceUnavailable(RuntimeError):
    """Batch invariance was asked for and cannot be delivered here; the message names what is missing."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _rows_invariant(f: Callable[..., torch.Tensor], x: torch.Tensor | tuple, counts: tuple[int, ...]) -> bool:
    """f's row i is the same bits computed with the first m rows, for every m in counts, and alone.
    x: a tensor, or a tuple of tensors whose rows go together (f takes them as arguments)."""
    xs = x if isinstance(x, tuple) else (x,)
    full = f(*xs)
    n = xs[0].shape[0]
    return all(_same(f(*(t[:m] for t in xs)), full[:m]) for m in counts) and all(
        _same(f(*(t[j:j + 1] for t in xs)), full[j:j + 1]) for j in (0, n // 2, n - 1))


def _split_rows_invariant(f: Callable[..., torch.Tensor], x: torch.Tensor, width: int) -> bool:
    """For odd row counts n whose n * width elements (the op's row width; x's may differ) are between one
    and two TORCH_GRAINs, so that a CPU elementwise op splits them between two threads in the middle of
    row n // 2: that row is the same bits alone. Several n, so its elements land in several loop tails."""
    first = TORCH_GRAIN // width + 1
    counts = [n for n in range(first | 1, x.shape[0] + 1, 2)][:8]
    return all(_same(f(x[:n])[n // 2:n // 2 + 1], f(x[n // 2:n // 2 + 1])) for n in counts)


def _linear_weights(model: torch.nn.Module) -> dict[tuple, tuple[torch.Tensor, torch.Tensor | None]]:
    """One (weight, bias) per distinct GEMM shape the model runs (2-D weights, one slice of stacked experts)."""
    out: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for mod in model.modules():
        for name, w in mod.named_parameters(recurse=False):
            if w.dim() == 3:  # stacked experts [E, N, K], or [E, K, N] multiplied as kern.experts_nk's (gpt-oss's)
                w = model.kern.experts_nk(w)[0] if getattr(mod, "transposed", False) else w[0]
            elif w.dim() != 2 or name != "weight":
                continue
            bias = getattr(mod, "bias", None) if name == "weight" else None
            # the parameters themselves (not detached copies): CPU parameters take the packed path
            out.setdefault((tuple(w.shape), bias is not None), (w, bias))
    return out


def self_check(model, block_size: int, cache_dtype: torch.dtype | None = None) -> list[str]:
    """Measure, on the model's device and dtype (attention over a KV cache of cache_dtype, default the
    model's) and with its real GEMM shapes, that each of its kernels gives every row the same bits whatever
    else is computed with it. Returns the ops checked; raises BatchInvarianceUnavailable naming the first
    that is not invariant here."""
    kern: Kernels = model.kern
    w0 = next(model.parameters())
    dev, dtype = w0.device, w0.dtype
    where = f"{dev.type} ({str(dtype).removeprefix('torch.')})"
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    def fail(op: str) -> BatchInvarianceUnavailable:
        return BatchInvarianceUnavailable(
            f"batch invariance cannot be delivered on {where}: the {op} kernel ({kern.name}) gives a row "
            f"different bits depending on the other rows of the batch")

    try:  # decided here, before any op runs: an unknown ROLLBUS_CPU_ATTENTION stops the start-up, named
        attention_implementation(dev.type, dtype, cache_dtype)
    except ValueError as e:
        raise BatchInvarianceUnavailable(f"batch invariance: {e}") from None
    checked = []
    small, big = (1, 2, 3, 5, 6, 7, 9, 13, 64), (1, 3, 5)
    with torch.inference_mode():
        for (shape, _), (w, b) in _linear_weights(model).items():
            n, kdim = shape
            x = rand(67, kdim).to(w.dtype)  # a router kept in fp32 (GLM, DeepSeek) multiplies fp32 rows
            if not _rows_invariant(lambda x: kern.linear(x, w, b), x, big if n > 8192 else small):
                raise fail(f"linear [{kdim} -> {n}]")
        checked.append("linear")
        cfg = model.cfg
        h, hq, hk, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ones = torch.ones(h, device=dev, dtype=dtype)
        if not _rows_invariant(lambda x: kern.rms_norm(x, ones, cfg.rms_norm_eps), rand(67, h), small):
            raise fail("rms_norm")
        for i in {cfg.intermediate_size, getattr(cfg, "moe_intermediate_size", 0) or cfg.intermediate_size}:
            act = _activation(model, i)
            split = rand(2 * TORCH_GRAIN // i, 2 * i) * 4
            if not _rows_invariant(act, rand(67, 2 * i) * 4, small) or not _split_rows_invariant(act, split, i):
                raise fail(f"{model.activation} [{i}]")
        pos = torch.randint(0, model.rope_cos.shape[0], (67,), generator=gen).to(dev)

        def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            qq, kk = kern.apply_rope(x[:, :hq], x[:, hq:], cos, sin)
            return torch.cat([qq.reshape(len(x), -1), kk.reshape(len(x), -1)], dim=1)

        d_rot = getattr(cfg, "rotary_dim", d)  # partial rotary (GLM) turns the leading dims only
        if not _rows_invariant(rope, (rand(67, hq + hk, d_rot), model.rope_cos[pos], model.rope_sin[pos]), small):
            raise fail("rotary")
        logits = (rand(9, cfg.vocab_size) * 4).float()
        if not _rows_invariant(lambda x: torch.log_softmax(x, dim=-1), logits, (1, 2, 5)):
            raise fail("log_softmax")
        checked += ["rms_norm", model.activation, "rotary", "log_softmax"]
        cap = getattr(cfg, "final_softcap", None)
        if cap:  # Gemma 3's cap * tanh(logits / cap), rows of the vocabulary's width cut by a thread split
            def softcap(x: torch.Tensor) -> torch.Tensor:
                return kern.tanh(x / cap) * cap

            wide = (rand(2 * TORCH_GRAIN // cfg.vocab_size + 17, cfg.vocab_size) * 40).float()
            if not _rows_invariant(softcap, logits * 10, (1, 2, 5)) or not _split_rows_invariant(
                    softcap, wide, cfg.vocab_size):
                raise fail("tanh (logit soft-cap)")
            checked.append("tanh")
        if model.num_moe_layers:
            moe = next(m for m in model.modules() if hasattr(m, "experts"))

            def experts(x: torch.Tensor) -> torch.Tensor:
                wts, ids = moe.route(x)  # the block's own router (softmax top-k, or GLM's grouped sigmoid)
                if hasattr(moe, "local_experts"):  # a block with its own experts' arithmetic (gpt-oss)
                    return moe.local_experts(x, wts, ids)
                return kern.moe_experts(x, ids, wts, moe.experts.gate_up_proj, moe.experts.down_proj)

            if not _rows_invariant(experts, rand(67, h), small):
                raise fail("moe routing / experts")
            checked.append("moe")
        heads = [w for m in model.modules() if hasattr(m, "head_linear_weights") for w in m.head_linear_weights()]
        for w in heads[:2]:  # MLA's absorbed projections (every layer's have these two shapes)
            if not _rows_invariant(lambda x, w=w: kern.head_linear(x, w), rand(67, w.shape[0], w.shape[2]), small):
                raise fail(f"head_linear [{w.shape[2]} -> {w.shape[1]}]")
        if heads:
            checked.append("head_linear")
        impl = attention_implementation(dev.type, dtype, cache_dtype) if kern.batch_invariant else kern.name
        for name, attend, portable in _attentions(model, block_size, rand):
            if not _attention_invariant(attend, hq, hk, d, block_size, rand, cache_dtype or dtype):
                raise fail(f"{name} ({'batch_invariant_torch' if portable and kern.batch_invariant else impl})")
        checked.append("paged_attention")
        for op, invariant in getattr(model, "invariance_checks", lambda rand: ())(rand):
            if not invariant():  # a model's own layers (a hybrid's Gated DeltaNet): (op, its measurement)
                raise fail(op)
            checked.append(op)
    return checked


def _activation(model, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's MLP / expert activation (`model.activation`, a Kernels op) on rows [T, 2I] of width i out."""
    kern, cfg = model.kern, model.cfg
    if model.activation == "clamped_swiglu":
        return lambda x: kern.clamped_swiglu(x, cfg.swiglu_alpha, cfg.swiglu_limit)
    op = getattr(kern, model.activation)
    return lambda x: op(x[:, :i], x[:, i:])


def _attentions(model, bs: int, rand) -> list[tuple[str, Callable[..., torch.Tensor], bool]]:
    """The model's attentions, as (name, attend(q, k, v, k_cache, v_cache, meta, scale), whether it is the torch
    path whatever attention_backend chose): paged attention, or gpt-oss's with sinks (random here: the sink
    logits' values change no order), and the same over a sliding window (of bs + 1 keys: every window masks
    across a block boundary) where some layer has one."""
    kern, cfg = model.kern, model.cfg
    windowed = [bs + 1] if any(getattr(cfg, "windows", ())) else []
    if any(hasattr(m, "sinks") for m in model.modules()):
        sinks = rand(cfg.num_heads)
        return [(f"paged attention with sinks{f', window {w}' if w else ''}",
                 lambda *a, w=w: sink_attention(*a, window=w, sinks=sinks), True) for w in [0, *windowed]]
    return [(f"paged attention{f', window {w}' if w else ''}", lambda *a, w=w: kern.paged_attention(*a, window=w),
             bool(w)) for w in [0, *windowed]]


def _attention_invariant(attend: Callable[..., torch.Tensor], hq: int, hk: int, d: int, bs: int, rand,
                         cache_dtype: torch.dtype) -> bool:
    """Three sequences computed (a) each alone as one prefill chunk (of 5 to 4 blocks + 6 rows), (b)
    together: chunked, batched with decodes, and two of them finishing in a decode-only step; every row's
    output must be the same bits. On CPU this measures the kernel path (attention_backend), with both of
    its ways to split work between threads (a row's heads apart or together)."""
    from ascend_ops.attention import PrefillChunk

    lens = (5, 2 * bs + 5, 4 * bs + 6)
    tables, nxt = [], 0
    for n in lens:
        nb = (n + bs - 1) // bs
        tables.append(torch.arange(nxt + nb - 1, nxt - 1, -1))  # blocks in reverse: not contiguous
        nxt += nb
    q = [rand(n, hq, d) for n in lens]
    k = [rand(n, hk, d) for n in lens]
    v = [rand(n, hk, d) for n in lens]
    dev = q[0].device
    cache = (rand(nxt, bs, hk, d).to(cache_dtype), rand(nxt, bs, hk, d).to(cache_dtype))

    def step(decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """decodes (seq, position), chunks (seq, start, end): outputs of each part, in order."""
        qs, ks, vs, slots, prefills = [], [], [], [], []
        for s, p in decodes:
            qs.append(q[s][p:p + 1]), ks.append(k[s][p:p + 1]), vs.append(v[s][p:p + 1])
            slots.append(tables[s][p // bs] * bs + p % bs)
        row = len(decodes)
        for s, a, b in chunks:
            pos = torch.arange(a, b)
            qs.append(q[s][a:b]), ks.append(k[s][a:b]), vs.append(v[s][a:b])
            slots.append(tables[s][pos // bs] * bs + pos % bs)
            prefills.append(PrefillChunk(row, b - a, b, tables[s].to(dev)))
            row += b - a
        meta = AttentionMetadata(torch.cat([x.reshape(-1) for x in slots]).to(dev), num_decodes=len(decodes),
                                 prefills=prefills)
        if decodes:
            w = max(len(tables[s]) for s, _ in decodes)
            t = torch.zeros(len(decodes), w, dtype=torch.int64)
            for i, (s, _) in enumerate(decodes):
                t[i, :len(tables[s])] = tables[s]
            meta.decode_block_tables, meta.decode_max_ctx = t.to(dev), max(p + 1 for _, p in decodes)
            meta.decode_ctx_lens = torch.tensor([p + 1 for _, p in decodes], device=dev)
        out = attend(torch.cat(qs), torch.cat(ks), torch.cat(vs), *cache, meta, d**-0.5)
        sizes = [1] * len(decodes) + [b - a for _, a, b in chunks]
        return list(out.split(sizes))

    alone = [step([], [(s, 0, n)])[0] for s, n in enumerate(lens)]
    a, b, c = lens
    first = step([], [(0, 0, a - 2), (1, 0, bs + 1), (2, 0, 3)])
    second = step([(0, a - 2)], [(1, bs + 1, b - 1), (2, 3, c)])
    third = step([(0, a - 1), (1, b - 1)], [])  # decodes of different table widths, without a prefill
    got = [torch.cat([first[0], second[0], third[0]]), torch.cat([first[1], second[1], third[1]]),
           torch.cat([first[2], second[2]])]
    return all(_same(x, y) for x, y in zip(alone, got))
