"""One decoder for the Llama family: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM,
Olmo2ForCausalLM (and, through moe.py, gemma3.py and glm4_moe.py, the families that share its attention).

They differ only in flags read from the HF config (decoder_config.py: qkv/o bias, per-head or whole-projection
q/k RMSNorm, OLMo 2's post-norms, clip_qkv, head_dim, partial rotary, each layer's sliding window), so one
implementation keeps the fast path in one place. The step is a flattened [T] token batch
(decodes first, then prefill chunks; no padding) over a paged KV cache; every matmul, norm and attention
goes through ascend_ops so an NPU or batch-invariant kernel can be swapped in underneath.
q/k/v and gate/up are fused into one GEMM each; HF checkpoint pieces are loaded into their slices.
Subclasses change the feed-forward block per layer (`_make_mlp`), the config (`config_class`) and the
checkpoint names (`_weight_targets`); attention, rope, norms and the forward loop stay here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from ascend_ops import packed_linear
from ascend_ops.attention import AttentionMetadata
from ascend_ops.batch_invariant import DEFAULT, Kernels
from ascend_ops.tp_group import SOLO, Solo
from workers.models.decoder_config import DecoderConfig, _rope_tables
from workers.models.tp_layout import Shard, shard_of
from workers.models.weight_map import Split, WeightMap


class KVSpec(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _param(*shape: int, dtype: torch.dtype, device: torch.device, ones: bool = False) -> nn.Parameter:
    make = torch.ones if ones else torch.empty
    return nn.Parameter(make(shape, dtype=dtype, device=device), requires_grad=False)


def _full_shard(cfg: DecoderConfig) -> Shard:
    return shard_of(cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, 0, 1)


class Attention(nn.Module):
    """Column-parallel q/k/v (this rank's heads), row-parallel o (one all-reduce, bias added once)."""

    lora_qkv = lora_o = None  # set by workers.lora.attach with --enable-lora

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__()
        self.kern, self.tp = kern, tp
        sh = shard or _full_shard(cfg)
        self.hq, self.hk, self.d = sh.hq, sh.hk, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = self.d**-0.5
        self.window = window
        self.clip = cfg.clip_qkv
        self.norm_offset = 0.0  # Gemma 3 scales by (1 + weight)
        self.rd = cfg.rotary_dim  # < head_dim: rope turns the leading rd dims of each head, the rest pass (GLM)
        qkv = (self.hq + 2 * self.hk) * self.d
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param(qkv, cfg.hidden_size, **kw)
        self.qkv_proj.bias = _param(qkv, **kw) if cfg.qkv_bias else None
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(cfg.hidden_size, self.hq * self.d, **kw)
        self.o_proj.bias = _param(cfg.hidden_size, **kw) if cfg.o_bias else None
        if cfg.qk_norm or cfg.qk_norm_full:  # per head, or over this rank's part of the whole projection
            self.q_norm = nn.Module()
            self.q_norm.weight = _param(self.d * (self.hq if cfg.qk_norm_full else 1), ones=True, **kw)
            self.k_norm = nn.Module()
            self.k_norm.weight = _param(self.d * (self.hk if cfg.qk_norm_full else 1), ones=True, **kw)
        self.qk_norm, self.qk_norm_full = cfg.qk_norm, cfg.qk_norm_full
        self.q_width, self.k_width = cfg.num_heads * self.d, cfg.num_kv_heads * self.d  # the whole projections

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        T = x.shape[0]
        kern = self.kern
        qkv = kern.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, (Hq+2Hk)*D]
        if self.lora_qkv is not None:  # LoRA adapters (workers/lora.py): each row's own delta
            qkv = self.lora_qkv(x, qkv)
        q, k, v = qkv.split([self.hq * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        if self.qk_norm_full:
            q = self._full_norm(q, self.q_norm.weight, self.q_width)
            k = self._full_norm(k, self.k_norm.weight, self.k_width)
        if self.clip is not None:
            q, k, v = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        q, k, v = q.view(T, self.hq, self.d), k.view(T, self.hk, self.d), v.view(T, self.hk, self.d)
        if self.qk_norm:
            qw, kw = self.q_norm.weight, self.k_norm.weight
            if self.norm_offset:
                qw, kw = qw + self.norm_offset, kw + self.norm_offset
            q, k = kern.rms_norm(q, qw, self.eps), kern.rms_norm(k, kw, self.eps)
        if self.rd < self.d:
            qr, kr = kern.apply_rope(q[..., : self.rd].contiguous(), k[..., : self.rd].contiguous(), cos, sin)
            q, k = torch.cat((qr, q[..., self.rd :]), -1), torch.cat((kr, k[..., self.rd :]), -1)
        else:
            q, k = kern.apply_rope(q, k, cos, sin)
        o = self._attend(q, k, v, kv, meta.for_layer(self.window))  # [T, Hq, D] (its layer group's tables)
        if self.tp.size == 1:
            out = kern.linear(o.view(T, self.hq * self.d), self.o_proj.weight, self.o_proj.bias)
            return out if self.lora_o is None else self.lora_o(o.view(T, self.hq * self.d), out)
        partial = kern.linear(o.view(T, self.hq * self.d), self.o_proj.weight)
        if self.lora_o is not None:  # this rank's input columns of A: a partial delta, reduced with the product
            partial = self.lora_o(o.view(T, self.hq * self.d), partial)
        return _reduce(self.tp, partial, self.o_proj.bias)


    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Write this step's k / v into the layer's cache and attend (gpt-oss adds its sinks here)."""
        return self.kern.paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window)

    def _full_norm(self, x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
        """RMSNorm over a whole projection [T, width] of which this rank holds x [T, width / tp] (the sum of
        squares all-reduced; layout_error keeps every KV head on one rank's slice, never replicated)."""
        if self.tp.size == 1:
            return self.kern.rms_norm(x.contiguous(), weight, self.eps)
        xf = x.float()
        var = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / width
        return weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)


def _reduce(tp: Solo, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel projection's output: the sum of every rank's partial product, then the bias once."""
    out = tp.all_reduce(partial)
    return out if bias is None else out + bias


class MLP(nn.Module):
    """Column-parallel gate/up (this rank's intermediate rows), row-parallel down (one all-reduce)."""

    lora_gate_up = lora_down = None  # set by workers.lora.attach with --enable-lora

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, kern: Kernels = DEFAULT,
                 tp: Solo = SOLO, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.kern, self.tp = kern, tp
        self.full_i = intermediate_size or cfg.intermediate_size  # a shared expert's differs from the dense
        self.i = self.full_i // tp.size
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * self.i, cfg.hidden_size, **kw)
        self.gate_up_proj.bias = _param(2 * self.i, **kw) if cfg.mlp_bias else None
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(cfg.hidden_size, self.i, **kw)
        self.down_proj.bias = _param(cfg.hidden_size, **kw) if cfg.mlp_bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial down projection, not yet reduced (a shared expert's joins the routed experts'
        before their one all-reduce); no biases (shared experts have none)."""
        gu = self.kern.linear(x, self.gate_up_proj.weight)
        return self.kern.linear(self.kern.silu_and_mul(gu[:, : self.i], gu[:, self.i :]), self.down_proj.weight)

    def forward(self, x: torch.Tensor, routed_experts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A dense layer routes nothing, so it records nothing in routed_experts."""
        kern = self.kern
        gu = kern.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)  # [T, 2I]
        if self.lora_gate_up is not None:
            gu = self.lora_gate_up(x, gu)
        h = kern.silu_and_mul(gu[:, : self.i], gu[:, self.i :])  # [T, I]
        if self.tp.size == 1:
            out = kern.linear(h, self.down_proj.weight, self.down_proj.bias)
            return out if self.lora_down is None else self.lora_down(h, out)
        partial = kern.linear(h, self.down_proj.weight)
        if self.lora_down is not None:  # this rank's input columns of A: a partial delta, reduced with the product
            partial = self.lora_down(h, partial)
        return _reduce(self.tp, partial, self.down_proj.bias)


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention  # DeepSeek-V3's layers: multi-head latent attention

    def __init__(self, cfg: DecoderConfig, mlp: nn.Module, dtype: torch.dtype, device: torch.device,
                 kern: Kernels = DEFAULT, shard: Shard | None = None, tp: Solo = SOLO, window: int = 0) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.norm, self.add_norm = kern.rms_norm, kern.add_rms_norm
        self.self_attn = self.attention_class(cfg, dtype, device, kern, shard, tp, window)
        self.mlp = mlp  # MLP, or a sparse MoE block with the same forward(x, routed_experts)
        self.post_norms = cfg.post_norms
        names = (("post_attention_layernorm", "post_feedforward_layernorm") if cfg.post_norms
                 else ("input_layernorm", "post_attention_layernorm"))
        for name in names:
            setattr(self, name, nn.Module())
            getattr(self, name).weight = _param(cfg.hidden_size, ones=True, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        routed_experts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.post_norms:  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x))
            x = x + self.norm(self.self_attn(x, cos, sin, meta, kv), self.post_attention_layernorm.weight, self.eps)
            return x + self.norm(self.mlp(x, routed_experts), self.post_feedforward_layernorm.weight, self.eps)
        h = self.self_attn(self.norm(x, self.input_layernorm.weight, self.eps), cos, sin, meta, kv)
        if self.add_norm is not None:  # the residual add and the norm after it in one pass
            x, n = self.add_norm(x, h, self.post_attention_layernorm.weight, self.eps)
        else:
            x = x + h
            n = self.norm(x, self.post_attention_layernorm.weight, self.eps)
        return x + self.mlp(n, routed_experts)


class _Body(nn.Module):
    """Named `model` inside DecoderLM so parameter names line up with HF's `model.` prefix."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device,
                 make_layer: Callable[[int], nn.Module], shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()  # vocabulary-parallel: this rank's rows (padded to ceil(V / tp))
        self.embed_tokens.weight = _param(shard.vp, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_layers))
        self.norm = nn.Module()
        self.norm.weight = _param(cfg.hidden_size, ones=True, dtype=dtype, device=device)


class DecoderLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM over a paged KV cache; built from the HF config dict.

    `kernels` (ascend_ops.batch_invariant) is chosen once here: the default ops, or the batch-invariant ones.
    `tp` (ascend_ops.tp_group) is this worker's tensor-parallel group: with more than one rank the model
    holds only this rank's shard (workers.models.tp_layout) and its forward takes part in the collectives.
    """

    config_class: type[DecoderConfig] = DecoderConfig
    layer_class: type[nn.Module] = DecoderLayer
    no_batch_invariance: str | None = None  # why --batch-invariant is refused for this family (None: it runs)
    activation = "silu_and_mul"  # the Kernels op of its MLPs / experts (the start-up self-check measures it)

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int | None = None,
        kernels: Kernels = DEFAULT,
        tp: Solo = SOLO,
    ) -> None:
        super().__init__()
        if kernels.batch_invariant and self.no_batch_invariance:
            arch = (hf_config.get("architectures") or ["?"])[0]
            raise NotImplementedError(f"{arch}: --batch-invariant is not supported yet ({self.no_batch_invariance})")
        device = torch.device(device)
        self.cfg = cfg = self.config_class.from_hf(hf_config)
        self.dtype = dtype
        self.kern = kernels
        self.tp = tp
        self.shard = shard_of(cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, tp.rank, tp.size)
        self.model = _Body(cfg, dtype, device, lambda i: self._make_layer(i, dtype, device), self.shard)
        self.lm_head = nn.Module()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one shared tensor
        else:
            self.lm_head.weight = _param(self.shard.vp, cfg.hidden_size, dtype=dtype, device=device)
            if self.shard.vp > self.shard.vocab_valid:  # padding rows: never real tokens, kept zero
                self.lm_head.weight.data[self.shard.vocab_valid:].zero_()
        if self.shard.vp > self.shard.vocab_valid:
            self.model.embed_tokens.weight.data[self.shard.vocab_valid:].zero_()
        cos, sin = _rope_tables(cfg, max_positions or cfg.max_positions, device, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin, persistent=False)
        self._weights = self._weight_targets()
        self._param_of: dict[str, nn.Parameter] = {}  # get_parameter's module walk, once per name

    def _make_layer(self, i: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Decoder layer `i` (a hybrid model chooses its mixer per layer: workers/models/qwen3_next.py)."""
        return self.layer_class(self.cfg, self._make_mlp(i, dtype, device), dtype, device, self.kern, self.shard,
                                self.tp, self.cfg.windows[i])

    def _make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (dense here; MoE subclasses choose per layer)."""
        return MLP(self.cfg, dtype, device, self.kern, self.tp)

    @property
    def kv_spec(self) -> KVSpec:
        """This worker's KV cache: its own KV heads only."""
        return KVSpec(self.cfg.num_layers, self.shard.hk, self.cfg.head_dim)

    @property
    def kv_planes(self) -> int:
        """Planes per layer of its KV cache: K and V (workers.kv_cache)."""
        return 2

    # Router capture: a dense model has no MoE layers, so callers can test `model.num_moe_layers`.
    @property
    def num_moe_layers(self) -> int:
        return 0

    @property
    def num_experts(self) -> int:
        return 0

    @property
    def moe_top_k(self) -> int:
        return 0

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        between_layers: Callable[[], None] | None = None,
        *,
        routed_experts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, H] of this step's tokens; writes their k/v into kv_caches.

        `between_layers` runs after each layer; raising there abandons the step (an abort pause).
        `routed_experts`: when a list, each MoE layer appends its top-k expert ids [T, top_k] (int64, on
        the model's device, best expert first) in layer order; dense layers append nothing.
        """
        x = self._embed(input_ids)  # [T, H]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, D]
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv, routed_experts)
            if between_layers is not None:
                between_layers()
        return self.kern.rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight
        if self.tp.size == 1:
            return w[input_ids]
        # vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is the lookup
        local = input_ids - self.shard.v0
        mine = (local >= 0) & (local < self.shard.vocab_valid)
        x = w[torch.where(mine, local, 0)] * mine.unsqueeze(1).to(w.dtype)
        return self.tp.all_reduce(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [N, V] for the rows the sampler needs (hidden [N, H]). With tensor parallelism every
        rank computes its vocabulary rows and tp rank 0 gets them all (the others get None): a collective,
        so every rank calls it for the same rows."""
        head = self.lm_head_product(hidden)
        return None if head is None else self.logits_from(head)

    @torch.inference_mode()
    def lm_head_product(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's product [N, V] for hidden [N, H], in a dtype whose widening to fp32 is exact (the
        model's own with one rank; fp32, gathered on tp rank 0, with tensor parallelism: a collective, the other
        ranks get None). `logits_from` turns rows of it into the fp32 logits compute_logits gives, so a caller
        can multiply many rows at once (one pass over the head's weights) and widen them a span at a time."""
        if self.tp.size == 1:
            return self.kern.linear(hidden, self.lm_head.weight)
        parts = self.tp.gather(self.kern.linear(hidden, self.lm_head.weight).float())
        return None if parts is None else torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]

    def logits_from(self, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits from rows of `lm_head_product`'s output."""
        return head.float()

    def lm_head_itemsize(self, dtype: torch.dtype) -> int:
        """Bytes a value of `lm_head_product`'s output takes for hidden states of `dtype`."""
        return dtype.itemsize if self.tp.size == 1 else 4

    # ---- weights ----------------------------------------------------------------------------------

    def _weight_targets(self) -> WeightMap:
        """Accepted checkpoint names and where each goes.

        HF's separate q/k/v and gate/up pieces map to slices of our fused weights; our own (fused)
        names map to themselves so a weight update may send either form.
        """
        t = WeightMap(n for n, _ in self.named_parameters())
        for li, layer in enumerate(self.model.layers):
            self._attention_targets(t, f"model.layers.{li}.self_attn")
            if isinstance(layer.mlp, MLP):
                self._mlp_targets(t, f"model.layers.{li}.mlp", layer.mlp)
        self._vocab_targets(t)
        return t

    def _vocab_targets(self, t: WeightMap) -> None:
        """This rank's vocabulary rows of the embedding and the LM head (tp > 1); a tied LM head's alias."""
        cfg, sh = self.cfg, self.shard
        if sh.size > 1:
            vocab = Split(0, cfg.vocab_size, ((sh.v0, sh.vocab_valid),))
            t.split("model.embed_tokens.weight", vocab, rows=sh.vocab_valid)
            if not cfg.tie_word_embeddings:
                t.split("lm_head.weight", vocab, rows=sh.vocab_valid)
        if cfg.tie_word_embeddings:
            t.alias("lm_head.weight", "model.embed_tokens.weight")

    def _attention_targets(self, t: WeightMap, a: str) -> None:
        """HF's q_proj / k_proj / v_proj of the attention named `a` as slices of its fused qkv_proj; this
        rank's heads of them (and of o_proj's columns, of a whole-projection QK-norm) under tp."""
        cfg, sh = self.cfg, self.shard
        d = cfg.head_dim
        qd, kd = sh.hq * d, sh.hk * d  # this rank's rows of q and of k (and v)
        sharded = sh.size > 1
        q_full, k_full = cfg.num_heads * d, cfg.num_kv_heads * d
        q_part, k_part = (sh.q0 * d, qd), (sh.k0 * d, kd)
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q_split = Split(0, q_full, (q_part,)) if sharded else None
            k_split = Split(0, k_full, (k_part,)) if sharded else None
            t.split(f"{a}.qkv_proj.{kind}", sharded and Split(0, q_full + 2 * k_full, (
                q_part, (q_full + k_part[0], kd), (q_full + k_full + k_part[0], kd))) or None)
            t.add(f"{a}.q_proj.{kind}", f"{a}.qkv_proj.{kind}", 0, qd, split=q_split)
            t.add(f"{a}.k_proj.{kind}", f"{a}.qkv_proj.{kind}", qd, kd, split=k_split)
            t.add(f"{a}.v_proj.{kind}", f"{a}.qkv_proj.{kind}", qd + kd, kd, split=k_split)
        t.split(f"{a}.o_proj.weight", sharded and Split(1, q_full, (q_part,)) or None)
        if cfg.qk_norm_full and sharded:
            t.split(f"{a}.q_norm.weight", Split(0, q_full, (q_part,)))
            t.split(f"{a}.k_norm.weight", Split(0, k_full, (k_part,)))

    def _mlp_targets(self, t: WeightMap, m: str, mlp: MLP) -> None:
        """HF's gate_proj / up_proj of the MLP named `m` as the two halves of its fused gate_up_proj."""
        i, full, sharded = mlp.i, mlp.full_i, self.shard.size > 1
        i_part = (self.shard.rank * i, i)
        for kind in ("weight", "bias") if self.cfg.mlp_bias else ("weight",):
            half = Split(0, full, (i_part,)) if sharded else None
            t.split(f"{m}.gate_up_proj.{kind}", sharded and Split(0, 2 * full, (i_part, (full + i_part[0], i))) or None)
            t.add(f"{m}.gate_proj.{kind}", f"{m}.gate_up_proj.{kind}", 0, i, split=half)
            t.add(f"{m}.up_proj.{kind}", f"{m}.gate_up_proj.{kind}", i, i, split=half)
        t.split(f"{m}.down_proj.weight", sharded and Split(1, full, (i_part,)) or None)

    def required_weight_names(self) -> set[str]:
        """HF names a complete checkpoint (as save_pretrained writes it) provides; lm_head is optional when
        tied. A checkpoint may instead carry our own fused names, which load_weights accepts too."""
        return set(self._weights.required)

    def checksum_names(self) -> set[str]:
        """The names /weight_checker reports a checksum under: the checkpoint's, and stacked expert tensors under
        their own names too (a checkpoint stores experts one by one, transformers 5 holds them stacked as
        `mlp.experts.gate_up_proj`, which is what a trainer's named_parameters() baseline names)."""
        return self.required_weight_names() | {n for n, p in self.named_parameters() if p.dim() == 3}

    def skipped_weight(self, name: str) -> bool:
        """Checkpoint tensors this model accepts and ignores (GLM's MTP layers); none here."""
        return False

    def missing_weights(self, loaded: set[str]) -> list[str]:
        """The required checkpoint names that `loaded` (what load_weights returned) does not cover: neither
        loaded themselves nor through their parameter's own (fused) name."""
        targets = self._weights.targets
        whole = {n for n in loaded if targets[n].param == n and targets[n].rows < 0 and targets[n].expert < 0}
        return sorted(n for n in self._weights.required - loaded if targets[n].param not in whole)

    def weight_destination(self, name: str) -> torch.Tensor:
        """The exact view of an existing parameter that checkpoint tensor `name` is copied into.

        Raises KeyError for an unknown name. Weight updates use it to validate every name, shape and
        dtype before the first byte is written, and to copy straight into place.
        """
        target = self._weights.targets.get(name)
        if target is None:
            raise KeyError(f"{self.cfg.architecture}: unknown checkpoint tensor {name!r}")
        param = self._param_of.get(target.param)
        if param is None:
            param = self._param_of[target.param] = self.get_parameter(target.param)
        dst = param.data
        if target.expert >= 0:
            dst = dst[target.expert]
        return dst.narrow(0, target.start, target.rows) if target.rows >= 0 else dst

    def weight_full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `name` (what a trainer sends); KeyError when unknown."""
        target = self._weights.targets.get(name)
        if target is None:
            raise KeyError(f"{self.cfg.architecture}: unknown checkpoint tensor {name!r}")
        shape = list(self.weight_destination(name).shape)
        if target.split is not None:
            shape[target.split.dim] = target.split.full
        return tuple(shape)

    def weight_source(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This worker's part of the whole checkpoint tensor `full` (shaped as weight_destination(name)): a
        view of it (one range), a concatenation (a fused tensor's pieces), or `full` itself (not sharded)."""
        split = self._weights.targets[name].split
        if split is None:
            return full
        pieces = [full.narrow(split.dim, a, n) for a, n in split.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=split.dim)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, local: bool = False) -> set[str]:
        """Copy tensors into the existing parameters in place (no re-allocation); returns names loaded.

        Used for the first load and for every later weight update, so parameter storage (and anything
        holding pointers to it, e.g. captured graphs) stays valid. The tensors are whole checkpoint tensors,
        of which a tp worker takes its part; `local`: they are this worker's parts already (its own copy).
        """
        loaded: set[str] = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq") or self.skipped_weight(name):
                continue
            dst = self.weight_destination(name)
            if not local:
                if tuple(w.shape) != self.weight_full_shape(name):
                    raise ValueError(f"{self.cfg.architecture}: tensor {name!r} has shape {tuple(w.shape)}, "
                                     f"expected {self.weight_full_shape(name)}")
                w = self.weight_source(name, w)
            if dst.shape != w.shape:
                raise ValueError(
                    f"{self.cfg.architecture}: tensor {name!r} has shape {tuple(w.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(w)
            loaded.add(name)
        packed_linear.forget(self)  # CPU packed copies of the old values (ascend_ops.packed_linear)
        return loaded
