"""Gated DeltaNet, the linear-attention layer of Qwen3-Next / Qwen3.5 (`linear_attn`; workers/models/qwen3_next.py
describes the model): its projections, the causal convolution, the gated delta rule in its chunked (prefill)
and recurrent (decode) forms over the state pool's slots, and the batch-invariant path (`GatedDeltaNet._rowwise`)
with the start-up measurement that it is invariant (`gdn_invariant`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ascend_ops import batch_invariant as bi
from ascend_ops.attention import AttentionMetadata, PrefillChunk
from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.batch_invariant_check import _same
from ascend_ops.invariant_activations import sigmoid as invariant_sigmoid
from ascend_ops.tp_group import SOLO, Solo
from workers.models.llama import _param
from workers.models.moe import MoEConfig
from workers.models.weight_map import Split

# `cfg` below is a workers.models.qwen3_next.HybridConfig (its linear_* fields), annotated by its base class,
# MoEConfig: qwen3_next imports this module.

CHUNK = 64  # tokens per chunk of the chunked gated delta rule (prefill)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (beta 1, threshold 20) as log1p(exp(x)): the same bits for an element wherever it sits (torch's
    softplus kernel gives the scalar tail of a vector loop other bits; exp and log1p do not)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens [L, H, d] (fp32; q, k normalised and q scaled; g, beta [L, H]) from `state`
    [H, dk, dv]: (outputs [L, H, dv], the state after the last token). Within a chunk the delta rule's
    triangular system is solved at once (WY form); across chunks the state carries."""
    L = q.shape[0]
    pad = (-L) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', d]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, L']
    H, n = q.shape[0], (L + pad) // CHUNK
    q, k, v = (x.reshape(H, n, CHUNK, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)  # [H, n, C]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [.., i, j]
    system = (kb @ k.transpose(-1, -2)) * decay  # its diagonal is taken as 1 (unitriangular)
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    qd = q * cum.exp().unsqueeze(-1)
    kd = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    last = cum[..., -1].exp()  # [H, n]
    out = torch.empty_like(u)
    s = state
    for c in range(n):
        fresh = u[:, c] - w[:, c] @ s
        out[:, c] = qd[:, c] @ s + inner[:, c] @ fresh
        s = s * last[:, c, None, None] + kd[:, c].transpose(-1, -2) @ fresh
    return out.reshape(H, -1, out.shape[-1])[:, :L].transpose(0, 1), s


def recurrent_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
    """One token of each of N sequences ([N, H, d], fp32) from their states [N, H, dk, dv], which are
    updated in place: returns o [N, H, dv]. The state is read once for both k^T S and q^T S (o = q^T S_new =
    decay q^T S + (q . k) delta), then scaled and updated in place: no temporaries of its size."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    s = state.view(n * h, dk, dv)
    decay = g.exp().reshape(n * h, 1)
    kq = torch.bmm(torch.stack((k, q), dim=2).view(n * h, 2, dk), s)  # [NH, 2, dv]
    delta = (v.reshape(n * h, dv) - decay * kq[:, 0]) * beta.reshape(n * h, 1)
    o = decay * kq[:, 1] + (q * k).sum(-1).reshape(n * h, 1) * delta
    s.mul_(decay.unsqueeze(-1))
    s.baddbmm_(k.reshape(n * h, dk, 1), delta.unsqueeze(1))
    return o.view(n, h, dv)


class GatedDeltaNet(nn.Module):
    """HF's `linear_attn` (module docstring), for a flattened batch of decodes and prefill chunks."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 tp: Solo = SOLO) -> None:
        """`cfg` holds this tp rank's heads (`local_heads`); out_proj's partial products are all-reduced."""
        super().__init__()
        self.kern, self.cfg, self.tp = kern, cfg, tp
        hk, hv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kw = dict(dtype=dtype, device=device)
        h = cfg.hidden_size
        if cfg.split_proj:
            for name, rows in (("in_proj_qkv", self.conv_dim), ("in_proj_z", self.value_dim), ("in_proj_b", hv),
                               ("in_proj_a", hv)):
                setattr(self, name, nn.Module())
                getattr(self, name).weight = _param(rows, h, **kw)
        else:
            self.in_proj_qkvz = nn.Module()
            self.in_proj_qkvz.weight = _param(2 * self.key_dim + 2 * self.value_dim, h, **kw)
            self.in_proj_ba = nn.Module()
            self.in_proj_ba.weight = _param(2 * hv, h, **kw)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, cfg.conv_kernel, **kw)
        self.dt_bias = _param(hv, ones=True, **kw)
        self.A_log = _param(hv, **kw)
        self.norm = nn.Module()
        self.norm.weight = _param(dv, ones=True, **kw)
        self.out_proj = nn.Module()
        self.out_proj.weight = _param(h, self.value_dim, **kw)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed q|k|v [T, C], z [T, Hv, dv], b, a [T, Hv])."""
        c, lin = self.cfg, self.kern.linear
        T, hk, hv, dk, dv = x.shape[0], c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim
        if c.split_proj:
            z = lin(x, self.in_proj_z.weight).view(T, hv, dv)
            return lin(x, self.in_proj_qkv.weight), z, lin(x, self.in_proj_b.weight), lin(x, self.in_proj_a.weight)
        r = hv // hk  # value heads per key head: Qwen3-Next packs [q_h, k_h, v_h.., z_h..] for each key head h
        qkvz = lin(x, self.in_proj_qkvz.weight).view(T, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = lin(x, self.in_proj_ba.weight).view(T, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return mixed, z.reshape(T, hv, dv), b.reshape(T, hv), a.reshape(T, hv)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        if self.kern.batch_invariant:
            beta = invariant_sigmoid(b.float())
            g = -self.A_log.float().exp() * _softplus(a.float() + self.dt_bias.float())
            out = self._rowwise(mixed, g, beta, meta, state)
            return self._output(out, z, x.dtype, bi.silu)
        c = self.cfg
        T = x.shape[0]
        conv_state, rec_state = state
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        w = self.conv1d.weight[:, 0, :]  # [C, K]
        slots = meta.state_slots
        out = torch.empty(T, c.lin_v_heads, c.lin_v_dim, dtype=torch.float32, device=x.device)
        nd = meta.num_decodes
        if nd:
            sl = slots[:nd]
            window = torch.cat((conv_state[sl], mixed[:nd].unsqueeze(-1).to(conv_state.dtype)), dim=-1)  # [N, C, K]
            conv_state[sl] = window[..., 1:]
            qkv = F.silu((window.to(w.dtype) * w).sum(-1)).to(x.dtype)
            q, k, v = self._heads(qkv)
            first = int(sl[0])
            if bool((sl == torch.arange(first, first + nd, device=sl.device)).all()):
                states = rec_state.narrow(0, first, nd)  # consecutive slots: updated where they are
            else:
                states = rec_state.index_select(0, sl)  # else gathered, updated, and put back
            out[:nd] = recurrent_delta_step(q, k, v, g[:nd], beta[:nd], states)
            if states.data_ptr() != rec_state[first].data_ptr():
                rec_state.index_copy_(0, sl, states)
        for i, ch in enumerate(meta.prefills):
            slot, rows = int(slots[nd + i]), slice(ch.q_start, ch.q_start + ch.q_len)
            seq = torch.cat((conv_state[slot], mixed[rows].t().to(conv_state.dtype)), dim=-1)  # [C, K-1+L]
            conv_state[slot] = seq[:, ch.q_len:]
            qkv = F.silu(F.conv1d(seq.unsqueeze(0).to(w.dtype), w.unsqueeze(1), groups=self.conv_dim)[0]).t()
            q, k, v = self._heads(qkv.to(x.dtype))
            out[rows], rec_state[slot] = chunked_delta_rule(q, k, v, g[rows], beta[rows], rec_state[slot])
        return self._output(out, z, x.dtype, F.silu)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype, silu) -> torch.Tensor:
        """The gated RMSNorm per value head, weight * norm(o) * silu(z) computed in fp32, then out_proj."""
        of = out.to(dtype).float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(dtype)
        gated = (self.norm.weight * normed).float() * silu(z.float())
        out = self.kern.linear(gated.to(dtype).reshape(out.shape[0], -1), self.out_proj.weight)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def _rowwise(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                 state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Batch-invariant mode (module docstring): the convolution and the recurrent step per token, the same
        operations for a decode and for any row of a prefill chunk of any length. Returns o [T, Hv, dv]."""
        c = self.cfg
        conv_state, rec_state = state
        w = self.conv1d.weight[:, 0, :].float()  # [C, K]
        K = c.conv_kernel
        nd, slots = meta.num_decodes, meta.state_slots
        # every sequence of the step: (first row, rows, slot); decodes are sequences of one row
        parts = [(i, 1, int(slots[i])) for i in range(nd)]
        parts += [(ch.q_start, ch.q_len, int(slots[nd + i])) for i, ch in enumerate(meta.prefills)]
        windows = []  # per part: [L, C, K] (the K inputs each row's convolution reads), in row order
        for start, n, slot in parts:
            seq = torch.cat((conv_state[slot], mixed[start:start + n].t().to(conv_state.dtype)), dim=-1)
            conv_state[slot] = seq[:, n:]
            windows.append(seq.unfold(1, K, 1).transpose(0, 1))
        win = torch.cat(windows).float()  # rows in step order (decodes, then the chunks in order)
        acc = win[..., 0] * w[:, 0]
        for j in range(1, K):  # K multiply-adds in order, each element alone
            acc = acc + win[..., j] * w[:, j]
        q, k, v = self._heads(bi.silu(acc.to(mixed.dtype)))
        out = torch.empty_like(v)
        # the sequences longest first, so the ones still running at position t are a prefix of the working copy
        order = sorted(range(len(parts)), key=lambda i: -parts[i][1])
        idx = torch.tensor([parts[i][2] for i in order], dtype=torch.int64, device=mixed.device)
        work = rec_state.index_select(0, idx)  # [S, Hv, dk, dv]
        starts = torch.tensor([parts[i][0] for i in order], dtype=torch.int64, device=mixed.device)
        lens = [parts[i][1] for i in order]
        for t in range(lens[0]):
            m = sum(1 for n in lens if n > t)
            rows = starts[:m] + t
            out[rows] = recurrent_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], work.narrow(0, 0, m))
        rec_state.index_copy_(0, idx, work)
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalised, q scaled, repeated to the value heads) and v, fp32 [N, Hv, d], from conv outputs."""
        c = self.cfg
        n = qkv.shape[0]
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = _l2norm(q.reshape(n, c.lin_k_heads, c.lin_k_dim)), _l2norm(k.reshape(n, c.lin_k_heads, c.lin_k_dim))
        if c.lin_v_heads != c.lin_k_heads:
            r = c.lin_v_heads // c.lin_k_heads
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q * c.lin_k_dim ** -0.5, k, v.reshape(n, c.lin_v_heads, c.lin_v_dim)


def local_heads(cfg: MoEConfig, size: int) -> MoEConfig:
    """The config of one tp rank's Gated DeltaNet layers: its share of the key and value heads (value heads go with
    their key head, r = Hv / Hk of them, so rank r holds key heads [r Hk/N, (r+1) Hk/N) and their value heads)."""
    return dataclasses.replace(cfg, lin_k_heads=cfg.lin_k_heads // size, lin_v_heads=cfg.lin_v_heads // size)


def tp_splits(cfg: MoEConfig, rank: int, size: int) -> dict[str, Split]:
    """Which part of each full Gated DeltaNet tensor (by its name under `linear_attn`) tp rank `rank` of `size`
    holds. The convolution's channels and Qwen3.5's in_proj_qkv are [q | k | v] (all key heads' q, then k, then
    the value heads' v); Qwen3-Next's in_proj_qkvz / in_proj_ba hold each key head's [q, k, v.., z..] / [b.., a..]
    together; out_proj's input columns are the value heads'."""
    hk, hv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    nk, nv = hk // size, hv // size
    k0, v0, r = rank * nk, rank * nv, hv // hk
    qkv = Split(0, 2 * hk * dk + hv * dv, ((k0 * dk, nk * dk), (hk * dk + k0 * dk, nk * dk),
                                           (2 * hk * dk + v0 * dv, nv * dv)))
    heads = Split(0, hv, ((v0, nv),))
    out = {"conv1d.weight": qkv, "dt_bias": heads, "A_log": heads,
           "out_proj.weight": Split(1, hv * dv, ((v0 * dv, nv * dv),))}
    if cfg.split_proj:
        return {**out, "in_proj_qkv.weight": qkv, "in_proj_z.weight": Split(0, hv * dv, ((v0 * dv, nv * dv),)),
                "in_proj_b.weight": heads, "in_proj_a.weight": heads}
    per = 2 * dk + 2 * r * dv
    return {**out, "in_proj_qkvz.weight": Split(0, hk * per, ((k0 * per, nk * per),)),
            "in_proj_ba.weight": Split(0, hk * 2 * r, ((k0 * 2 * r, nk * 2 * r),))}


def gdn_invariant(layer: GatedDeltaNet, rand) -> bool:
    """Measure (the start-up self-check, ascend_ops.batch_invariant_check.self_check) that `layer` in batch-invariant
    mode gives every row and every final state the same bits: three sequences of 5, 19 and 70 tokens each
    computed alone as one prefill, then together in other slots, chunked, beside decodes and as decodes only.
    `rand(*shape)` draws inputs of the model's dtype on its device."""
    c, dev = layer.cfg, layer.out_proj.weight.device
    lens, h = (5, 19, 70), c.hidden_size
    xs = [rand(n, h) for n in lens]
    conv_shape = (layer.conv_dim, c.conv_kernel - 1)

    def pool() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(4, *conv_shape, dtype=xs[0].dtype, device=dev),
                torch.zeros(4, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim, dtype=torch.float32, device=dev))

    def step(state, decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]],
             slot: list[int]) -> list[torch.Tensor]:
        """decodes (seq, position), chunks (seq, start, end), sequence s in state slot slot[s]."""
        rows = [xs[s][p:p + 1] for s, p in decodes] + [xs[s][a:b] for s, a, b in chunks]
        prefills, row = [], len(decodes)
        for _, a, b in chunks:
            prefills.append(PrefillChunk(row, b - a, b, torch.zeros(1, dtype=torch.int64)))
            row += b - a
        slots = [slot[s] for s, _ in decodes] + [slot[s] for s, _, _ in chunks]
        meta = AttentionMetadata(torch.zeros(row, dtype=torch.int64), num_decodes=len(decodes), prefills=prefills,
                                 state_slots=torch.tensor(slots, dtype=torch.int64, device=dev))
        out = layer(torch.cat(rows), meta, state)
        return list(out.split([1] * len(decodes) + [b - a for _, a, b in chunks]))

    alone_state = pool()
    alone = [step(alone_state, [], [(s, 0, n)], [0, 1, 2])[0] for s, n in enumerate(lens)]
    state = pool()
    slot = [3, 0, 2]
    a, b, n = lens
    first = step(state, [], [(0, 0, a - 2), (1, 0, 11), (2, 0, 1)], slot)
    second = step(state, [(0, a - 2)], [(1, 11, b - 1), (2, 1, n)], slot)
    third = step(state, [(1, b - 1), (0, a - 1)], [], slot)
    got = [torch.cat([first[0], second[0], third[1]]), torch.cat([first[1], second[1], third[0]]),
           torch.cat([first[2], second[2]])]
    same_states = all(_same(alone_state[i][:3], state[i][torch.tensor(slot)]) for i in (0, 1))
    return same_states and all(_same(x, y) for x, y in zip(alone, got))
