"""The worker's paged KV cache: one allocation, viewed per layer as (k_cache, v_cache).

Layout [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim]: two planes (K and V) for
attention with KV heads; one for multi-head latent attention (DeepSeek-V3's MLA: per token one row of
kv_lora_rank + qk_rope_head_dim, a model's `kv_planes` == 1), whose views are (plane, plane). It is a
single tensor so the whole cache can later be released and re-created by tag (sleep mode discards it)
without touching the model; `views` are rebuilt after a re-allocation.

Hybrid models (Qwen3-Next / Qwen3.5, a model with `state_spec`): beside the blocks of its attention layers, a
state pool of `state_slots` slots (one per sequence that can run at once, --max-num-seqs), each holding a
sequence's convolution state (model dtype) and recurrent state (fp32) in every linear-attention layer. It is
part of this cache: allocated, released (sleep) and re-created with the blocks, and sized out of the same
budget (plan_num_blocks' `reserved_bytes`). `views` then has one entry per model layer: (k, v) for attention
layers, (conv [slots, C, K-1], recurrent [slots, Hv, dk, dv]) for linear ones. The scheduler assigns the slots
(StepPlan.state_slots); the runner zeroes a slot when a sequence starts from position 0 (`reset_state`).
"""

from __future__ import annotations

import os

import torch

from ascend_ops.platform import (
    Platform,
    host_total_bytes,
    populate_host_tensor,
    process_resident_bytes,
    releasable_host_tensor,
)
from engine.config import CPU_KV_SPACE_ENV, DEFAULT_GPU_MEMORY_UTILIZATION, cpu_kv_space_bytes

CPU_DEFAULT_KV_BYTES = 1 << 30


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's for auto, else bfloat16 / float16 (--kv-cache-dtype)."""
    return model_dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, planes: int = 2, *, state=None, state_slots: int = 0,
                 linear_layers: tuple[int, ...] = ()):
        if planes not in (1, 2):
            raise ValueError(f"a KV cache has 1 (latent) or 2 (K and V) planes, not {planes}")
        self.shape = (num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.tensor: torch.Tensor | None = None
        self.state_spec, self.state_slots, self.linear_layers = state, state_slots, linear_layers
        self.conv_state: torch.Tensor | None = None  # [linear layers, slots, C, K-1]
        self.rec_state: torch.Tensor | None = None  # [linear layers, slots, Hv, dk, dv] fp32
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, planes: int = 2) -> int:
        return (num_layers * planes * block_size * num_kv_heads * head_dim
                * torch.empty(0, dtype=dtype).element_size())

    @staticmethod
    def bytes_per_state_slot(state, dtype: torch.dtype) -> int:
        """One sequence's recurrent state in every linear-attention layer (0 without a state_spec)."""
        if state is None:
            return 0
        conv = state.conv[0] * state.conv[1] * torch.empty(0, dtype=dtype).element_size()
        rec = state.recurrent[0] * state.recurrent[1] * state.recurrent[2] * 4
        return state.num_layers * (conv + rec)

    @classmethod
    def for_model(cls, model, block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device,
                  state_slots: int = 1) -> KVCache:
        """The cache `model` computes over (its kv_spec, and one plane for latent attention; a hybrid model's
        state pool of `state_slots` slots)."""
        state = getattr(model, "state_spec", None)
        return cls(*model.kv_spec, block_size, num_blocks, dtype, device, planes=model.kv_planes, state=state,
                   state_slots=state_slots if state is not None else 0,
                   linear_layers=tuple(getattr(model, "linear_layers", ())))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensor, self.conv_state, self.rec_state)
                   if t is not None)

    def reset_state(self, slots: list[int]) -> None:
        """Zero these slots' state in every linear layer (a sequence computed from position 0)."""
        if self.conv_state is not None and slots:
            idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
            self.conv_state[:, idx] = 0
            self.rec_state[:, idx] = 0

    def allocate(self) -> None:
        # Zero-filled, not uninitialised: padded decode rows read unused slots, which must be finite.
        # On the host, an anonymous mapping (zero-filled by the kernel), which goes back to the OS the moment
        # the cache is released (sleep); faulted in whole now, at start and at wake, as an accelerator's cache
        # is allocated whole (ascend_ops.platform.populate_host_tensor: else decode steps pay for it).
        if self.device.type == "cpu":
            numel = 1
            for d in self.shape:
                numel *= d
            self.tensor = releasable_host_tensor(numel, self.dtype).view(self.shape)
            populate_host_tensor(self.tensor)
        else:
            self.tensor = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        last = self.shape[1] - 1  # (K, V), or (plane, plane)
        self.views = [(self.tensor[i, 0], self.tensor[i, last]) for i in range(self.shape[0])]
        if self.state_spec is not None:
            st, n = self.state_spec, self.state_slots
            self.conv_state = torch.zeros((st.num_layers, n, *st.conv), dtype=self.dtype, device=self.device)
            self.rec_state = torch.zeros((st.num_layers, n, *st.recurrent), dtype=torch.float32, device=self.device)
            attn, lin = iter(self.views), iter(zip(self.conv_state, self.rec_state))
            total = self.shape[0] + st.num_layers
            self.views = [next(lin) if i in self.linear_layers else next(attn) for i in range(total)]

    def release(self) -> None:
        self.views = []
        self.tensor = self.conv_state = self.rec_state = None


def plan_num_blocks(platform: Platform, *, bytes_per_block: int, kv_cache_memory_bytes: int | None,
                    num_blocks_override: int | None, gpu_memory_utilization: float | None, device_index: int,
                    reserved_bytes: int = 0) -> int:
    """How many blocks this worker can hold: an override, an explicit byte budget, or the memory fraction.

    Accelerators: the fraction (default DEFAULT_GPU_MEMORY_UTILIZATION) of the device memory free after the
    weights. CPU, as vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE GiB, else --kv-cache-memory-bytes, else, when
    --gpu-memory-utilization is given, that fraction of the host's total memory less what this process holds
    already (weights, packed weights, the warm-up: call it after them), else CPU_DEFAULT_KV_BYTES. On CPU the
    cache is committed at allocation (populate_host_tensor), so a budget over the host's available memory is
    refused here (ValueError naming the values) instead of ending in the OOM killer.

    `reserved_bytes` (a hybrid model's state pool) comes out of the same budget before it is cut into blocks;
    a budget that cannot hold it and one block is refused. With num_blocks_override the pool is extra."""
    if num_blocks_override:
        return num_blocks_override
    if platform.name != "cpu":
        if kv_cache_memory_bytes is None:
            fraction = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
            kv_cache_memory_bytes = int(platform.free_memory_bytes(device_index) * fraction)
        return _blocks_after(kv_cache_memory_bytes, reserved_bytes, bytes_per_block, "the KV-cache budget")
    env = cpu_kv_space_bytes(os.environ)
    if env is not None:
        budget, source = env, CPU_KV_SPACE_ENV
    elif kv_cache_memory_bytes is not None:
        budget, source = kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    elif gpu_memory_utilization is not None:
        total, held = host_total_bytes(), process_resident_bytes()
        budget, source = int(total * gpu_memory_utilization) - held, "--gpu-memory-utilization"
        if budget < bytes_per_block:
            raise ValueError(
                f"--gpu-memory-utilization {gpu_memory_utilization} on CPU is {gpu_memory_utilization:.0%} of the "
                f"host's {_gib(total)} GiB, and this worker holds {_gib(held)} GiB already (weights, packed "
                f"weights): no room for a KV cache; raise it, or size the cache with --kv-cache-memory-bytes or "
                f"{CPU_KV_SPACE_ENV}")
    else:
        budget, source = CPU_DEFAULT_KV_BYTES, "the CPU default"
    free = platform.free_memory_bytes(device_index)
    if budget > free:
        raise ValueError(f"a KV cache of {_gib(budget)} GiB ({source}) does not fit the host's {_gib(free)} GiB "
                         f"of available memory; lower it")
    return _blocks_after(budget, reserved_bytes, bytes_per_block, source)


def _blocks_after(budget: int, reserved: int, per_block: int, source: str) -> int:
    if not reserved:
        return max(1, budget // per_block)
    if budget - reserved < per_block:
        raise ValueError(f"the KV-cache budget of {budget} bytes ({source}) cannot hold the recurrent-state pool "
                         f"({reserved} bytes: one slot per --max-num-seqs sequence) and a KV block; raise the "
                         f"budget or lower --max-num-seqs")
    return (budget - reserved) // per_block


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"
