"""Test helpers: tiny random HF checkpoints, an MoE upcycled from SmolLM2, and a minimal paged-KV runner
that drives DecoderLM.

The runner is deliberately independent of the engine's scheduler/worker: it only owns a block
allocator and builds AttentionMetadata (decodes first, then prefill chunks), so model tests exercise
the model + attention contract and nothing else.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_ops.attention import AttentionMetadata, PrefillChunk
from engine.model_store import COMPLETE_MARKER, _locked, cache_dir, is_complete
from workers.models.checkpoint import iter_checkpoint, iter_safetensors, load_hf_config
from workers.models.llama import DecoderLM
from workers.models.registry import build_model

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
    # Mistral: a sliding window of 7 keys, shorter than the test prompts and across block boundaries.
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                      head_dim=24, sliding_window=7, rope_theta=10000.0)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                  rope_theta=500000.0)),  # (with attention_bias greedy collapses on a prompt)
    # Qwen2-MoE: a shared expert with its gate, a dense layer, sliding windows on the lower layers.
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, vocab_size=1200, tie_word_embeddings=False,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, mlp_only_layers=[1],
                                         use_sliding_window=True, sliding_window=6, max_window_layers=2,
                                         rope_theta=1000000.0)),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                  intermediate_size=48, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0,
                                  rope_theta=10000.0)),
    # Gemma 3: sliding layers (window 6) around a global one, two rotary bases (the global one linearly
    # scaled), soft-capped logits.
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, vocab_size=1000, head_dim=32, sliding_window=6,
                                        tie_word_embeddings=False,  # tied, greedy repeats one token
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 100000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
    # GLM-4.5: a dense first layer, 8 experts in 4 groups (top-2 groups, top-3 experts), a shared expert,
    # a correction bias, partial rotary, QK-norm, q/k/v bias.
    "glm4_moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False, head_dim=32,
                                       n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                       n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                                       routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
    # DeepSeek-V3 / Kimi-K2: MLA (q through its LoRA rank, a 32-wide latent, decoupled rotary keys of 8 dims,
    # interleaved), YaRN with mscale != mscale_all_dim, a dense first layer, 8 experts in 4 groups (top-2
    # groups, top-3 experts) with a correction bias, a shared expert, routed_scaling_factor.
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False,
                                             num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                             n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                              "factor": 4.0, "original_max_position_embeddings": 64,
                                                              "mscale": 1.0, "mscale_all_dim": 0.8,
                                                              "beta_fast": 32, "beta_slow": 1})),
    # gpt-oss: a sliding layer (window 6) then a full one, sinks, YaRN (not truncated), 8 experts top-2 with
    # biases, the SwiGLU clamp low enough to bite (1.0 here, 7.0 in the real models).
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False, head_dim=16,
                                     intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                     sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                     swiglu_limit=1.0,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False})),
    # Qwen3-Next: Gated DeltaNet layers around a gated full-attention one (2 key heads, 4 value heads), partial
    # rotary, 8 experts top-2 with a gated shared expert, a dense layer (mlp_only_layers).
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False,
                                           head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                     "linear_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=64, mlp_only_layers=[1],
                                           norm_topk_prob=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5})),
    # Qwen3.5 text, dense and MoE: the same layers with split linear-attention projections.
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False,
                                          head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"],
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=16,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5})),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=False,
                                                 head_dim=16, layer_types=["linear_attention", "full_attention"],
                                                 linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                                                 num_experts_per_tok=2, moe_intermediate_size=48,
                                                 shared_expert_intermediate_size=64,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5})),
}
HYBRID = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}  # zero-centred norms (1 + weight), as Gemma 3's
MOE = {"qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen2_moe", "olmoe"}
# issue 34's: test_arch_oracle.py in CI, the exhaustive suites slow
NEW_ARCHS = ["mistral", "olmo2", "qwen2_moe", "olmoe", "gemma3", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next"]
SHARDED = {"qwen2"}  # saved with a tiny max_shard_size so the index path is exercised


def hf_config_class(name: str):
    """transformers' config class `name`, or a skip naming it: the tiny checkpoints are built with
    transformers, and an older one (the floors lane's 4.56) lacks the newer families' classes (Qwen3-Next
    came in 4.57). The engine itself reads config.json without transformers."""
    import pytest
    import transformers

    try:
        return getattr(transformers, name)
    except AttributeError:
        pytest.skip(f"transformers {transformers.__version__} has no {name}, which builds this test's checkpoint")


def make_tiny_checkpoint(arch: str, folder: Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """Save a small random fp32 HF checkpoint for `arch` into folder (safetensors); returns folder.

    Every parameter (norms and biases included) is randomised, and init_std is large enough that
    greedy decoding keeps changing tokens instead of collapsing onto one. `overrides` replace config
    fields of the variant (e.g. vocab_size=49152 to serve text through SmolLM2's tokenizer).
    """
    import transformers

    cls_name, extra = TINY_CONFIGS[arch]
    cfg = hf_config_class(cls_name)(**{**_COMMON, **extra, **overrides}, initializer_range=init_std)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif "norm" in name:  # Gemma 3 and the hybrids scale by (1 + weight) (not their gated linear_attn.norm)
                centred = (arch == "gemma3" or arch in HYBRID) and "linear_attn.norm" not in name
                p.copy_((0.0 if centred else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):  # gpt-oss: logits of the size of a row's scores, so they matter
                p.copy_(2.0 * torch.randn(p.shape, generator=g))
            else:  # bias
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
        for name, b in model.named_buffers():  # GLM / DeepSeek routers' correction bias (a buffer in HF)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="40KB" if arch in SHARDED else "1GB")
    return folder


def tiny_with_oracle(arch: str, folder: Path) -> tuple[str, Path, Any]:
    """(arch, checkpoint folder, the HF transformers model loaded from it in fp32): an oracle test's fixture."""
    import transformers

    make_tiny_checkpoint(arch, folder)
    return arch, folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# gpt-oss as OpenAI publishes it: the experts in MXFP4 (workers/models/mxfp4.py), the rest unquantised.
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [E, rows, cols] tensor (cols a multiple of 32) as MXFP4 (blocks, scales): per 32 values the
    smallest power of two that brings their largest magnitude within 6, then each value's nearest code."""
    from workers.models.mxfp4 import FP4_VALUES

    e, rows, cols = w.shape
    g = w.reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    codes = ((g / torch.exp2(exp)[..., None])[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def make_mxfp4_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The tiny gpt-oss checkpoint (intermediate size 64: MXFP4 groups 32 values) with its experts' weights
    quantised and saved as HF and OpenAI save gpt-oss: `*_blocks` / `*_scales` of the transposed tensors,
    `quantization_config` mxfp4 in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint("gpt_oss", folder, seed, intermediate_size=64)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(folder / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2).contiguous())
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": MXFP4_CONFIG}, indent=2))
    return folder


def perturb(model, seed: int = 7, scale: float = 0.05) -> None:
    """Move every parameter of `model` by scale x N(0, 1), seeded: the trainer's next weights in an update test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The upcycled SmolLM2 MoE (reference/models.md): bump the version whenever the recipe below changes.
UPCYCLED_VERSION = "smollm2-moe-v1"
UPCYCLED = dict(num_experts=4, top_k=2, noise=0.02, seed=0)


def upcycled_smollm2_moe(smollm2_dir: Path, progress: bool = True) -> Path:
    """A Mixtral-style MoE made from SmolLM2-135M: in every layer, 4 experts that are copies of the dense
    MLP plus Gaussian noise (2% of each matrix's std), a random router (std 1/sqrt(hidden)), top-2.
    Routing changes the logits (by up to about 2.6) while text stays fluent (perplexity 6.18 vs 6.26 for
    the dense model on test_moe_oracle's sentence; greedy "The capital of France is" -> " Paris.").
    Saved once in HF's standard Mixtral layout (config.json from MixtralConfig, per-expert w1/w2/w3
    tensors, 1.5 GB fp32) with SmolLM2's tokenizer files, under <rollbus cache>/test-models/
    <UPCYCLED_VERSION>; later calls return the cached folder."""
    target = cache_dir() / "test-models" / UPCYCLED_VERSION
    if is_complete(target):
        return target
    with _locked(target):
        if not is_complete(target):
            _build_upcycled(Path(smollm2_dir), target, progress)
    return target


def _build_upcycled(src: Path, target: Path, progress: bool) -> None:
    import transformers
    from safetensors.torch import save_file

    def say(msg: str) -> None:
        if progress:
            print(f"upcycled SmolLM2 MoE: {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    e, k, noise = UPCYCLED["num_experts"], UPCYCLED["top_k"], UPCYCLED["noise"]
    c = load_hf_config(src)
    g = torch.Generator().manual_seed(UPCYCLED["seed"])
    rope = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    cfg = transformers.MixtralConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        rope_parameters=rope, tie_word_embeddings=c["tie_word_embeddings"], bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"], num_local_experts=e, num_experts_per_tok=k, sliding_window=None)
    say(f"building from {src} ({e} experts, top-{k}, noise {noise}) into {target}")
    state: dict[str, torch.Tensor] = {}
    dense = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight")
    piece = {"gate": "w1", "up": "w3", "down": "w2"}
    for name, t in iter_safetensors(src):
        m = dense.fullmatch(name)
        if m is None:
            state[name] = t
            continue
        layer, kind = m.groups()
        if kind == "gate":
            say(f"layer {int(layer) + 1}/{c['num_hidden_layers']}")
        for x in range(e):
            state[f"model.layers.{layer}.block_sparse_moe.experts.{x}.{piece[kind]}.weight"] = (
                t + noise * t.std() * torch.randn(t.shape, generator=g))
    for layer in range(c["num_hidden_layers"]):
        router = torch.randn(e, c["hidden_size"], generator=g) * c["hidden_size"] ** -0.5
        state[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = router
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        say(f"saving {sum(t.numel() for t in state.values()) / 1e6:.0f}M parameters")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        cfg.save_pretrained(tmp)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / f).is_file():
                shutil.copy(src / f, tmp / f)
        (tmp / COMPLETE_MARKER).write_text("")
        os.chmod(tmp, 0o755)
        if target.exists():  # a crashed earlier attempt (no marker)
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"done in {time.perf_counter() - started:.1f} s")


def load_model(folder: Path, dtype: torch.dtype = torch.float32) -> DecoderLM:
    model = build_model(load_hf_config(folder), dtype, "cpu")
    loaded = model.load_weights(iter_checkpoint(folder))
    missing = model.required_weight_names() - loaded
    assert not missing, f"checkpoint lacks {sorted(missing)}"
    return model


STATE_SLOTS = 8  # hybrid models in PagedRunner: sequence ids 0..7 are their own state slots


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
        planes = [[torch.zeros(shape, dtype=dt) for _ in range(self.model.kv_planes)] for _ in range(L)]
        self.kv = [(p[0], p[-1]) for p in planes]  # latent attention (one plane): (plane, plane)
        state = getattr(self.model, "state_spec", None)
        if state is not None:  # hybrid: linear layers get (conv, recurrent) state of STATE_SLOTS slots (slot = seq)
            attn = iter(self.kv)
            self.kv = [(torch.zeros(STATE_SLOTS, *state.conv, dtype=dt),
                        torch.zeros(STATE_SLOTS, *state.recurrent, dtype=torch.float32))
                       if i in self.model.linear_layers else next(attn) for i in range(self.model.cfg.num_layers)]
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
        self,
        decodes: list[tuple[int, int]] = (),
        prefills: list[tuple[int, list[int]]] = (),
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """Run one step: decodes (seq, token) first, then prefill chunks (seq, tokens).

        Returns fp32 logits [T, V] for every token of the step, in the flattened order. `model_kwargs`
        (between_layers, routed_experts) go to the model's forward.
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
        if getattr(self.model, "state_spec", None) is not None:
            order = [seq for seq, _ in decodes] + [seq for seq, _ in prefills]
            for seq, toks in prefills:  # a sequence's first chunk starts from a zero state
                if self.lens[seq] == len(toks):
                    for i in self.model.linear_layers:
                        self.kv[i][0][seq].zero_(), self.kv[i][1][seq].zero_()
            meta.state_slots = torch.tensor(order, dtype=torch.int64)
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
        hidden = self.model(ids_t, pos_t, meta, self.kv, **model_kwargs)
        return self.model.compute_logits(hidden)

    def greedy(
        self, prompts: dict[int, list[int]], steps: int, routes: dict[int, torch.Tensor] | None = None
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Prefill all prompts in one step, then decode all sequences together for `steps` tokens.

        Returns generated tokens and the logits [steps, V] that chose them, per sequence. With `routes` (an MoE
        model), each sequence's routed experts [positions, moe_layers, k] of every token it fed (its prompt
        and all but its last generated token) are put there, captured in these very steps.
        """
        seqs = list(prompts)
        fed: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}

        def step(work: list[tuple[int, Any]], **kw: Any) -> torch.Tensor:
            if routes is None:
                return self.step(**kw)
            routed: list[torch.Tensor] = []
            logits = self.step(**kw, routed_experts=routed)
            per_token = torch.stack(routed, dim=1)  # [T, moe_layers, k] in the step's token order
            start = 0
            for s, toks in work:
                n = len(toks) if isinstance(toks, list) else 1
                fed[s].append(per_token[start : start + n])
                start += n
            return logits

        work = [(s, prompts[s]) for s in seqs]
        logits = step(work, prefills=work)
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
                work = list(zip(seqs, toks))
                last = step(work, decodes=work)
        if routes is not None:
            routes.update({s: torch.cat(r) for s, r in fed.items()})
        return out, {s: torch.stack(r) for s, r in rows.items()}
