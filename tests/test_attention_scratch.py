"""Decode attention reuses one step's gather buffers across layers (AttentionMetadata.decode_scratch): every
layer must still read its own cache, and a layer whose cache has another shape or dtype gets fresh buffers.
Each call is compared bitwise with the same call on a fresh metadata (no scratch)."""

from __future__ import annotations

import torch

from ascend_ops.attention import AttentionMetadata, paged_attention

BS = 4


def _meta(tables: torch.Tensor, lens: list[int]) -> AttentionMetadata:
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    return AttentionMetadata(slots, num_decodes=len(lens), decode_block_tables=tables,
                             decode_ctx_lens=torch.tensor(lens), decode_max_ctx=max(lens))


def _layer(g: torch.Generator, hk: int, d: int, dtype=torch.float32, hq: int = 4, n: int = 3, blocks: int = 12):
    cache = [torch.randn(blocks, BS, hk, d, generator=g).to(dtype) for _ in range(2)]
    qkv = [torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hk, hk)]
    return qkv, cache


def test_layers_sharing_a_step_read_their_own_caches_bitwise():
    g = torch.Generator().manual_seed(0)
    tables = torch.tensor([[3, 7, 0], [1, 0, 0], [5, 9, 11]])
    lens = [6, 2, 11]
    shared = _meta(tables, lens)
    # two layers of one shape, then one with other kv heads, one with another head size, one in bf16
    layers = [_layer(g, 2, 8), _layer(g, 2, 8), _layer(g, 1, 8), _layer(g, 2, 16), _layer(g, 2, 16, torch.bfloat16)]
    for (q, k, v), (kc, vc) in layers:
        fresh_kc, fresh_vc = kc.clone(), vc.clone()
        got = paged_attention(q, k, v, kc, vc, shared, 0.3)
        want = paged_attention(q, k, v, fresh_kc, fresh_vc, _meta(tables, lens), 0.3)
        assert got.dtype == q.dtype and torch.equal(got, want)
        assert torch.equal(kc, fresh_kc) and torch.equal(vc, fresh_vc)  # this step's k/v written once, same slots
