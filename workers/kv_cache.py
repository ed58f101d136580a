"""The worker's paged KV cache: one allocation, viewed per layer as (k_cache, v_cache).

Layout [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. It is a single tensor so the
whole cache can later be released and re-created by tag (sleep mode discards it) without touching the
model; `views` are rebuilt after a re-allocation.
"""

from __future__ import annotations

import os

import torch

from ascend_ops.platform import Platform, populate_host_tensor, releasable_host_tensor
from engine.config import cpu_kv_space_bytes

CPU_DEFAULT_KV_BYTES = 1 << 30


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device):
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.tensor: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

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
        self.views = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(self.shape[0])]

    def release(self) -> None:
        self.views = []
        self.tensor = None


def plan_num_blocks(platform: Platform, *, bytes_per_block: int, kv_cache_memory_bytes: int | None,
                    num_blocks_override: int | None, gpu_memory_utilization: float, device_index: int) -> int:
    """How many blocks this worker can hold: an override, an explicit byte budget, or (accelerators) the
    configured fraction of the memory left after the weights; CPU: VLLM_CPU_KVCACHE_SPACE GiB when set, else
    the byte budget, else 1 GiB."""
    if num_blocks_override:
        return num_blocks_override
    if platform.name == "cpu":
        kv_cache_memory_bytes = cpu_kv_space_bytes(os.environ) or kv_cache_memory_bytes
    if kv_cache_memory_bytes is None:
        if platform.name == "cpu":
            kv_cache_memory_bytes = CPU_DEFAULT_KV_BYTES
        else:
            kv_cache_memory_bytes = int(platform.free_memory_bytes(device_index) * gpu_memory_utilization)
    return max(1, kv_cache_memory_bytes // bytes_per_block)
