"""The worker's paged KV cache: one allocation, viewed per layer as (k_cache, v_cache).

Layout [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim]: two planes (K and V) for
attention with KV heads; one for multi-head latent attention (DeepSeek-V3's MLA: per token one row of
kv_lora_rank + qk_rope_head_dim, a model's `kv_planes` == 1), whose views are (plane, plane). It is a
single tensor so the whole cache can later be released and re-created by tag (sleep mode discards it)
without touching the model; `views` are rebuilt after a re-allocation.
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
                 dtype: torch.dtype, device: torch.device, planes: int = 2):
        if planes not in (1, 2):
            raise ValueError(f"a KV cache has 1 (latent) or 2 (K and V) planes, not {planes}")
        self.shape = (num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.tensor: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, planes: int = 2) -> int:
        return (num_layers * planes * block_size * num_kv_heads * head_dim
                * torch.empty(0, dtype=dtype).element_size())

    @classmethod
    def for_model(cls, model, block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """The cache `model` computes over (its kv_spec, and one plane for latent attention)."""
        return cls(*model.kv_spec, block_size, num_blocks, dtype, device, planes=model.kv_planes)

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

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

    def release(self) -> None:
        self.views = []
        self.tensor = None


def plan_num_blocks(platform: Platform, *, bytes_per_block: int, kv_cache_memory_bytes: int | None,
                    num_blocks_override: int | None, gpu_memory_utilization: float | None, device_index: int) -> int:
    """How many blocks this worker can hold: an override, an explicit byte budget, or the memory fraction.

    Accelerators: the fraction (default DEFAULT_GPU_MEMORY_UTILIZATION) of the device memory free after the
    weights. CPU, as vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE GiB, else --kv-cache-memory-bytes, else, when
    --gpu-memory-utilization is given, that fraction of the host's total memory less what this process holds
    already (weights, packed weights, the warm-up: call it after them), else CPU_DEFAULT_KV_BYTES. On CPU the
    cache is committed at allocation (populate_host_tensor), so a budget over the host's available memory is
    refused here (ValueError naming the values) instead of ending in the OOM killer."""
    if num_blocks_override:
        return num_blocks_override
    if platform.name != "cpu":
        if kv_cache_memory_bytes is None:
            fraction = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
            kv_cache_memory_bytes = int(platform.free_memory_bytes(device_index) * fraction)
        return max(1, kv_cache_memory_bytes // bytes_per_block)
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
    return max(1, budget // bytes_per_block)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"
