"""A worker's start-up, before it joins the bus: the model (this rank's shard) on its device, the checks the
flags ask for, the warm-up, the KV cache sized by the flags, and the ModelRunner over them, plus what the
worker reports about itself (its Hello and /server_info). Every refusal here stops the start-up with a
SystemExit naming the value (an unknown kernel variable, no room for a KV cache, a batch-invariance
self-check that fails on this device). The socket loop is workers.worker_actor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_ops import attention, cpu_kernels, packed_linear
from ascend_ops.batch_invariant import attention_implementation, kernels
from ascend_ops.batch_invariant_check import BatchInvarianceUnavailable, self_check
from ascend_ops.platform import Platform, host_huge_pages, tune_host_allocator
from bus.messages import WorkerInfo
from engine.config import EngineConfig
from engine.model_store import resolve_model
from engine.rl_config import Determinism
from engine.topology import layout
from workers.kv_cache import (
    KVCache,
    cache_dtype,
    mixed_window,
    plan_checkpoints,
    plan_num_blocks,
    split_window_pool,
    window_pool_blocks,
)
from workers.loader import load_model
from workers.lora import slots_for as lora_slots_for
from workers.model_runner import ModelRunner, warm_up


def attention_paths(model, device_type: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """What the worker's attention runs, as /server_info reports it: the path the process chose for its mode
    (sliding-window layers take it too: both CPU kernels read a row's window); attention with sinks (gpt-oss's,
    in every layer) runs the invariant attention in both modes."""
    if model.kern.batch_invariant or any(hasattr(m, "sinks") for m in model.modules()):
        return attention_implementation(device_type, dtype, kv_dtype)  # ascend_ops.batch_invariant
    return attention.implementation(device_type, dtype, kv_dtype)


@dataclass(slots=True)
class Loaded:
    model: torch.nn.Module
    kv: KVCache
    runner: ModelRunner
    info: WorkerInfo  # what the worker reports (its Hello, /server_info's `workers`)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameter storage this process holds (each storage counted once: tied weights share)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        st = p.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def load_worker(cfg: EngineConfig, *, name: str, rank: int, tp_size: int, device: torch.device, device_index: int,
                platform: Platform, det: Determinism, tp) -> Loaded:
    """Everything a worker computes with, ready for its first step; `tp` is its tensor-parallel group."""
    model, hf_config, max_model_len = load_model(cfg, device, kernels(det.batch_invariant), tp)
    host_allocator = tune_host_allocator() if device.type == "cpu" else None  # the steps' buffers, not the weights
    dtype = next(model.parameters()).dtype
    kv_dtype = cache_dtype(cfg.cache.kv_cache_dtype, dtype)
    checked: list[str] = []
    if det.batch_invariant:  # measured here, on this device, with this model's shapes: never assumed
        try:
            checked = self_check(model, cfg.cache.block_size, kv_dtype)
        except BatchInvarianceUnavailable as e:
            raise SystemExit(f"rollbus: {det.source}: {e}") from None
    try:  # the CPU kernel is built (first start on a machine) or loaded here, not in the first step
        attn = attention_paths(model, device.type, dtype, kv_dtype)
        cpu_linear = packed_linear.describe(dtype) if device.type == "cpu" else None
    except ValueError as e:  # an unknown ROLLBUS_CPU_ATTENTION / ROLLBUS_CPU_KERNELS / ROLLBUS_CPU_PACKED_LINEAR
        raise SystemExit(str(e)) from None
    # once-per-process costs here, not in the first request's step; and resident before the KV cache is sized
    warm_s = warm_up(model, rank=rank, block_size=cfg.cache.block_size, device=device, kv_dtype=kv_dtype)
    nl, nkv, hd = model.kv_spec
    per_block = KVCache.bytes_per_block(nl, nkv, hd, cfg.cache.block_size, kv_dtype, model.kv_planes)
    # a hybrid model's recurrent-state pool: one slot per sequence that can run, out of the same budget
    state_slots = cfg.scheduler.max_num_seqs if getattr(model, "state_spec", None) is not None else 0
    reserved = state_slots * KVCache.bytes_per_state_slot(getattr(model, "state_spec", None), kv_dtype)
    try:
        num_blocks = plan_num_blocks(platform, bytes_per_block=per_block,
                                     kv_cache_memory_bytes=cfg.cache.kv_cache_memory_bytes,
                                     num_blocks_override=cfg.cache.num_gpu_blocks_override,
                                     gpu_memory_utilization=cfg.cache.gpu_memory_utilization, device_index=device_index,
                                     reserved_bytes=reserved)
    except ValueError as e:  # no room for a KV cache in what the flags allow
        raise SystemExit(f"rollbus: {name}: {e}") from None
    window, window_layers = mixed_window(model)
    window_blocks = 0
    if window_layers:  # the sliding-window layers' own pool: each sequence's window; the full layers get the rest
        need = window_pool_blocks(window, cfg.cache.block_size, cfg.scheduler.max_num_seqs,
                                  cfg.scheduler.max_num_batched_tokens)
        num_blocks, window_blocks = split_window_pool(num_blocks, nl, len(window_layers), need)
    if num_blocks * cfg.cache.block_size < max_model_len:
        pool = (f" after its recurrent-state pool ({state_slots} slots for --max-num-seqs, {reserved} bytes)"
                if state_slots else "")
        raise SystemExit(
            f"KV cache of {num_blocks} blocks x {cfg.cache.block_size} tokens{pool} cannot hold one sequence of "
            f"max_model_len={max_model_len}; raise --kv-cache-memory-bytes or lower --max-model-len"
            + (" or --max-num-seqs" if state_slots else ""))
    if cfg.cache.mamba_block_size and not state_slots:
        raise SystemExit(f"rollbus: --mamba-block-size applies to hybrid models (linear-attention state); "
                         f"{cfg.model.model} has none")
    checkpoints = 0
    if state_slots and cfg.cache.enable_prefix_caching:  # a hybrid's prefix hits resume from state checkpoints
        checkpoints, num_blocks = plan_checkpoints(
            num_blocks, bytes_per_block=per_block, bytes_per_slot=reserved // state_slots,
            max_num_seqs=state_slots, min_blocks=-(-max_model_len // cfg.cache.block_size),
            extra=bool(cfg.cache.num_gpu_blocks_override))
    kv = KVCache.for_model(model, cfg.cache.block_size, num_blocks, kv_dtype, device, state_slots=state_slots,
                           window_blocks=window_blocks, checkpoints=checkpoints)
    runner = ModelRunner(model, kv, rank=rank, block_size=cfg.cache.block_size, device=device, seed=cfg.model.seed,
                         logprobs_mode=cfg.rl.logprobs_mode, return_routed_experts=cfg.rl.enable_return_routed_experts,
                         tokenizer_path=None if cfg.rl.tokens_only else
                         resolve_model(cfg.model.model, progress=False) / "tokenizer.json",
                         structured_outputs=cfg.model.structured_outputs_config,
                         lora=lora_slots_for(cfg, model, device),
                         return_sampling_mask=cfg.rl.return_sampling_mask)
    runner.grammar.build_in_background()  # structured outputs' tokenizer, joined before the worker joins the bus
    info = WorkerInfo(
        num_blocks=num_blocks, max_model_len=max_model_len, vocab_size=model.cfg.vocab_size, device=str(device),
        model=cfg.model.model_name, tensor_parallel_size=tp_size, tp_rank=rank, weight_bytes=weight_bytes(model),
        dtype=str(dtype).removeprefix("torch."), kv_cache_bytes=kv.nbytes,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."), kernels=model.kern.name, attention=attn,
        batch_invariant_checked=checked, cpu_linear=cpu_linear, host_allocator=host_allocator,
        warm_up_s=round(warm_s, 3), host_huge_pages=host_huge_pages() if device.type == "cpu" else None,
        cpu_threads=cpu_kernels.threads() if device.type == "cpu" else None, layout=layout(cfg),
        state_slots=state_slots, state_checkpoints=checkpoints, kv_window=shared_window(model) or window,
        window_blocks=window_blocks)
    return Loaded(model, kv, runner, info)


def shared_window(model) -> int:
    """The sliding window every attention layer of `model` has, where they share one (the scheduler then frees
    the blocks that slid out of it); 0 where any layer attends to everything or the windows differ, or for a
    hybrid model (its linear-attention layers keep state, not blocks)."""
    windows = getattr(getattr(model, "cfg", None), "windows", ())
    if not windows or getattr(model, "state_spec", None) is not None or len(set(windows)) != 1:
        return 0
    return int(windows[0])
