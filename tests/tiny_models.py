"""Test helpers: tiny random HF checkpoints and a minimal paged-KV runner that drives DecoderLM.

The runner is deliberately independent of the engine's scheduler/worker: it only owns a block
allocator and builds AttentionMetadata (decodes first, then prefill chunks), so model tests exercise
the model + attention contract and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_ops.attention import AttentionMetadata, PrefillChunk
from engine.models.checkpoint import iter_safetensors, load_hf_config
from engine.models.llama import DecoderLM
from engine.models.registry import build_model

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Each variant exercises different flags: bias layout, tying, head_dim != hidden/heads, rope scaling.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                  attention_bias=True, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=True,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=32))),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=3, vocab_size=1200, tie_word_embeddings=True,
                                  rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, vocab_size=1500, tie_word_embeddings=False,
                                  head_dim=32, rope_theta=1000000.0)),
    # MoE: a dense layer among the sparse ones (mlp_only_layers / decoder_sparse_step), norm_topk_prob both
    # ways, top-k of 8 and of 4 experts.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, vocab_size=1500, tie_word_embeddings=False,
                                         head_dim=32, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_hidden_layers=4, vocab_size=1500, tie_word_embeddings=True,
                                              num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                                              decoder_sparse_step=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                      num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0)),
}
MOE = {"qwen3_moe", "qwen3_moe_norm", "mixtral"}
SHARDED = {"qwen2"}  # saved with a tiny max_shard_size so the index path is exercised


def make_tiny_checkpoint(arch: str, folder: Path, seed: int = 0, init_std: float = 0.2) -> Path:
    """Save a small random fp32 HF checkpoint for `arch` into folder (safetensors); returns folder.

    Every parameter (norms and biases included) is randomised, and init_std is large enough that
    greedy decoding keeps changing tokens instead of collapsing onto one.
    """
    import transformers

    cls_name, extra = TINY_CONFIGS[arch]
    cfg = getattr(transformers, cls_name)(**_COMMON, **extra, initializer_range=init_std)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # bias
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="40KB" if arch in SHARDED else "1GB")
    return folder


def load_model(folder: Path, dtype: torch.dtype = torch.float32) -> DecoderLM:
    model = build_model(load_hf_config(folder), dtype, "cpu")
    loaded = model.load_weights(iter_safetensors(folder))
    missing = model.required_weight_names() - loaded
    assert not missing, f"checkpoint lacks {sorted(missing)}"
    return model


@dataclass
class PagedRunner:
    """Owns small paged k/v caches and turns (seq, tokens) work into one flattened step."""

    model: DecoderLM
    num_blocks: int = 64
    block_size: int = 4
    seed: int = 0
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[int, list[int]] = field(default_factory=dict, init=False)
    lens: dict[int, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        L, hk, d = self.model.kv_spec
        shape = (self.num_blocks, self.block_size, hk, d)
        dt = self.model.dtype
        self.kv = [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)) for _ in range(L)]
        # Hand out blocks in a scrambled order so sequences are never physically contiguous.
        g = torch.Generator().manual_seed(self.seed)
        self.free = torch.randperm(self.num_blocks, generator=g).tolist()

    def _place(self, seq: int, n: int) -> tuple[list[int], list[int], int]:
        """Positions and cache slots for n new tokens of seq; grows its block table."""
        start = self.lens.get(seq, 0)
        table = self.tables.setdefault(seq, [])
        ctx = start + n
        while len(table) * self.block_size < ctx:
            table.append(self.free.pop())
        pos = list(range(start, ctx))
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size for p in pos]
        self.lens[seq] = ctx
        return pos, slots, ctx

    def step(
        self, decodes: list[tuple[int, int]] = (), prefills: list[tuple[int, list[int]]] = ()
    ) -> torch.Tensor:
        """Run one step: decodes (seq, token) first, then prefill chunks (seq, tokens).

        Returns fp32 logits [T, V] for every token of the step, in the flattened order.
        """
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        ctx_lens: list[int] = []
        for seq, tok in decodes:
            p, s, ctx = self._place(seq, 1)
            ids.append(tok), pos.extend(p), slots.extend(s), ctx_lens.append(ctx)
        chunks: list[PrefillChunk] = []
        for seq, toks in prefills:
            p, s, ctx = self._place(seq, len(toks))
            table = torch.tensor(self.tables[seq], dtype=torch.int64)
            chunks.append(PrefillChunk(q_start=len(ids), q_len=len(toks), ctx_len=ctx, block_table=table))
            ids.extend(toks), pos.extend(p), slots.extend(s)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), prefills=chunks)
        if decodes:
            width = max(len(self.tables[seq]) for seq, _ in decodes)
            tables = torch.zeros(len(decodes), width, dtype=torch.int64)
            for row, (seq, _) in enumerate(decodes):
                tables[row, : len(self.tables[seq])] = torch.tensor(self.tables[seq])
            meta.num_decodes = len(decodes)
            meta.decode_block_tables = tables
            meta.decode_ctx_lens = torch.tensor(ctx_lens, dtype=torch.int64)
            meta.decode_max_ctx = max(ctx_lens)
        ids_t, pos_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)
        hidden = self.model(ids_t, pos_t, meta, self.kv)
        return self.model.compute_logits(hidden)

    def greedy(
        self, prompts: dict[int, list[int]], steps: int
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Prefill all prompts in one step, then decode all sequences together for `steps` tokens.

        Returns generated tokens and the logits [steps, V] that chose them, per sequence.
        """
        seqs = list(prompts)
        logits = self.step(prefills=[(s, prompts[s]) for s in seqs])
        ends = torch.tensor([len(prompts[s]) for s in seqs]).cumsum(0) - 1
        last = logits[ends]  # [n, V]
        out: dict[int, list[int]] = {s: [] for s in seqs}
        rows: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
        for i in range(steps):
            toks = last.argmax(-1).tolist()
            for s, t, row in zip(seqs, toks, last):
                out[s].append(t)
                rows[s].append(row)
            if i + 1 < steps:
                last = self.step(decodes=list(zip(seqs, toks)))
        return out, {s: torch.stack(r) for s, r in rows.items()}
