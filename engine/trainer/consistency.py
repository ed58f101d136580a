"""Trainer side of training consistency: a Hugging Face model on the engine's batch-invariant kernels.

    from engine.trainer import use_engine_kernels
    model = use_engine_kernels(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    logprobs = torch.log_softmax(model(input_ids).logits, dim=-1)   # == the engine's, bit for bit

Every op of the forward goes through the same functions the engine's workers run with batch invariance on
(ascend_ops.batch_invariant): linear layers and the LM head (rows padded to a multiple of 4), attention
(each query row over its own keys laid out as KV-cache blocks of `block_size`, by the engine's CPU kernel
or, where the engine runs its torch path, that path), the MoE router and
expert sums, and SiLU (HF's F.silu gives a row other bits when a CPU thread split falls inside it). HF's
RMSNorm, rotary embedding, the product with up_proj and embedding are already the same arithmetic as the
engine's and stay. The logits come back in fp32 (the engine's log_softmax runs on fp32 logits).
Autograd works through all of it; attention keeps nothing for backward but q, k and v (its backward is
the exact dense gradient, one sequence at a time), so a batch's memory grows as HF's own does. Batches
must be right-padded (real tokens first, default positions): a row's result then depends on nothing but its own tokens.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ascend_ops import batch_invariant as bi

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "MixtralForCausalLM")
ATTENTION = "rollbus_batch_invariant"
DEFAULT_BLOCK_SIZE = 16  # the engine's --block-size default; the attention's key blocks must match it


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    return bi.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*lead, -1)


def _lm_head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _linear_forward(self, x).float()


def _engine_attention_forward(query, key, value, scaling: float, block_size: int) -> torch.Tensor:
    """The engine's invariant attention over a right-padded batch, causal: query [B, Hq, S, D], key/value
    [B, Hk, S, D] -> [B, S, Hq, D]. Keys and values are laid out as KV-cache blocks of `block_size` tokens
    (sequence b in blocks b * nblk ..), and every query row reads the first position + 1 of its sequence's,
    as the engine's paged attention does. Where the engine runs the CPU kernel
    (ascend_ops.batch_invariant.attention_backend) this is one call of it; else the torch path's
    _attend_rows, in chunks of at most PAIR_BUDGET (row, block) pairs, as in the engine."""
    B, hq, S, d = query.shape
    hk = key.shape[1]
    nblk = -(-S // block_size)
    pad = nblk * block_size - S

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, Hk, S, D] -> [B * nblk, block, Hk, D]
        t = t.transpose(1, 2)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
        return t.reshape(B * nblk, block_size, hk, d)

    kc, vc = blocks(key), blocks(value)
    q = query.transpose(1, 2).reshape(B * S, hq, d)
    dev = query.device
    tables = (torch.arange(B, device=dev)[:, None] * nblk + torch.arange(nblk, device=dev)[None, :])  # [B, nblk]
    lens = torch.arange(1, S + 1, device=dev).repeat(B)
    out = torch.empty_like(q)
    kern = bi.attention_kernel(q, kc)
    if kern is not None:
        row_table = torch.arange(B, device=dev).repeat_interleave(S)
        kern.paged_attention_rows(out, q.contiguous(), kc.contiguous(), vc.contiguous(), tables, row_table, lens,
                                  scaling)
        return out.view(B, S, hq, d)
    tables = tables.repeat_interleave(S, dim=0)  # [B * S, nblk]
    nb = (lens + block_size - 1) // block_size
    rows = max(1, bi.PAIR_BUDGET // nblk)
    for a in range(0, B * S, rows):
        out[a:a + rows] = bi._attend_rows(q[a:a + rows], tables[a:a + rows], lens[a:a + rows], nb[a:a + rows],
                                          kc, vc, scaling)
    return out.view(B, S, hq, d)


class _EngineAttention(torch.autograd.Function):
    """Forward: the engine's attention, bit for bit, with nothing kept for autograd but q, k and v (the
    blocked copies of keys and values it makes are freed when it returns). Backward: the exact
    gradient of causal softmax attention, computed densely one sequence at a time in fp32 (gradients need
    ordinary float agreement with HF's, not the engine's bits), so memory is one sequence's [Hq, S, S]."""

    @staticmethod
    def forward(ctx, query, key, value, scaling: float, block_size: int):
        ctx.save_for_backward(query, key, value)
        ctx.scaling = scaling
        return _engine_attention_forward(query, key, value, scaling, block_size)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [B, S, Hq, D]
        query, key, value = ctx.saved_tensors
        B, hq, S, d = query.shape
        g = hq // key.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool, device=query.device).tril()
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for b in range(B):
            q = query[b].float()  # [Hq, S, D]
            k = key[b].float().repeat_interleave(g, dim=0)
            v = value[b].float().repeat_interleave(g, dim=0)
            do = grad_out[b].transpose(0, 1).float()  # [Hq, S, D]
            p = torch.softmax((q @ k.transpose(1, 2) * ctx.scaling).masked_fill(~causal, float("-inf")), dim=-1)
            dp = do @ v.transpose(1, 2)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * ctx.scaling
            dq[b] = (ds @ k).to(query.dtype)
            dk[b] = (ds.transpose(1, 2) @ q).view(-1, g, S, d).sum(1).to(key.dtype)
            dv[b] = (p.transpose(1, 2) @ do).view(-1, g, S, d).sum(1).to(value.dtype)
        return dq, dk, dv, None, None


def _attention(block_size: int):
    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """query [B, Hq, S, D], key/value [B, Hk, S, D] -> ([B, S, Hq, D], None), causal, right-padded."""
        return _EngineAttention.apply(query, key, value, scaling, block_size), None

    return attend


def _router_forward(fp32_weights: bool):
    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = bi.linear(h, self.weight)
        weights, ids = bi.INVARIANT.moe_route(logits, self.top_k, fp32_weights or bool(self.norm_topk_prob))
        return logits, weights if fp32_weights else weights.to(logits.dtype), ids
    return forward


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return bi.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


class _SiLU(nn.Module):
    """The engine's SiLU (ascend_ops.batch_invariant.silu) in place of an MLP's act_fn."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bi.silu(x)


def _check_padding(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
    if attention_mask is not None:
        m = attention_mask.to(torch.int64)
        if bool((m[:, 1:] > m[:, :-1]).any()):
            raise ValueError("use_engine_kernels: batches must be right-padded (a 0 in attention_mask before a 1)")
    if position_ids is not None:
        raise ValueError("use_engine_kernels: position_ids are not supported (right-padded rows use 0, 1, 2, ...)")
    return self._rollbus_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def use_engine_kernels(model: nn.Module, block_size: int = DEFAULT_BLOCK_SIZE) -> nn.Module:
    """Put a transformers model of a supported architecture on the engine's batch-invariant kernels, in
    place, and return it. `block_size` must be the engine's --block-size (default 16)."""
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    if type(model).__name__ not in SUPPORTED:
        raise ValueError(f"use_engine_kernels: architecture {type(model).__name__} ({arch}) is not supported; "
                         f"supported: {', '.join(SUPPORTED)}")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention(block_size))
    model.set_attn_implementation(ATTENTION)
    mixtral = type(model).__name__.startswith("Mixtral")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.forward = types.MethodType(_lm_head_forward if name == "lm_head" else _linear_forward, mod)
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and not isinstance(mod.down_proj, nn.Module):
            mod.forward = types.MethodType(_experts_forward, mod)
        elif type(mod).__name__.endswith("TopKRouter"):
            mod.forward = types.MethodType(_router_forward(mixtral), mod)
        if isinstance(getattr(mod, "act_fn", None), nn.Module) and not isinstance(mod.act_fn, _SiLU):
            if not isinstance(mod.act_fn, nn.SiLU) and type(mod.act_fn).__name__ != "SiLUActivation":
                raise ValueError(f"use_engine_kernels: {name}.act_fn is {type(mod.act_fn).__name__}; the engine "
                                 "runs SiLU only")
            mod.act_fn = _SiLU()
    if not hasattr(model, "_rollbus_forward"):
        model._rollbus_forward = model.forward
        model.forward = types.MethodType(_check_padding, model)
    return model
