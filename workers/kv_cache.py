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
With prefix caching the pool has `checkpoints` more slots after those (engine.state_checkpoints): a running
slot's state is copied into one at a block boundary (`save_checkpoint`) and back into a running slot for a
prefix hit (`load_checkpoint`); `checkpoint_pos` says which position each holds (forgotten on re-allocation).

Models whose attention layers mix windows (gpt-oss, Gemma 3; `window_layers`): two layer groups, each with its
own blocks (engine.window_blocks): `tensor` holds the full-attention layers' `num_blocks` blocks and
`window_tensor` the sliding-window layers' `window_blocks`, a pool sized for each running sequence's window
(window_pool_blocks), not its whole length. A layer's view is into its group's tensor, and its group's block
table (StepPlan.window_tables for the window group) indexes it.
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


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks the sliding-window group needs so that it never runs out before the full group: every running
    sequence's window ((window - 1) / block_size blocks, plus the one it fills and one it straddles), and the
    blocks a step's tokens fill, twice (the step in flight's are released a plan later: async scheduling, and
    prefix caching, which releases only hashed blocks)."""
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_seq + 2 * -(-max_num_batched_tokens // block_size)


def split_window_pool(num_blocks: int, num_layers: int, window_layers: int, window_need: int) -> tuple[int, int]:
    """(full-group blocks, window-group blocks) out of the bytes of `num_blocks` blocks of all `num_layers`
    layers: the window group gets what it needs (at most num_blocks), the full group the rest."""
    win = min(window_need, num_blocks)
    return num_blocks + (num_blocks - win) * window_layers // (num_layers - window_layers), win


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, planes: int = 2, *, state=None, state_slots: int = 0,
                 linear_layers: tuple[int, ...] = (), window_layers: tuple[int, ...] = (), window_blocks: int = 0,
                 checkpoints: int = 0):
        if planes not in (1, 2):
            raise ValueError(f"a KV cache has 1 (latent) or 2 (K and V) planes, not {planes}")
        if window_layers and (state is not None or not window_blocks or len(window_layers) >= num_layers):
            raise ValueError("a window group needs blocks, full-attention layers beside it and no state pool")
        nw = len(window_layers)
        self.shape = (num_layers - nw, planes, num_blocks, block_size, num_kv_heads, head_dim)
        self.window_shape = (nw, planes, window_blocks, block_size, num_kv_heads, head_dim) if nw else None
        self.window_layers, self.window_blocks = window_layers, window_blocks
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.tensor: torch.Tensor | None = None
        self.window_tensor: torch.Tensor | None = None
        self.state_spec, self.state_slots, self.linear_layers = state, state_slots, linear_layers
        self.checkpoints = checkpoints if state is not None else 0
        self.checkpoint_pos: dict[int, int] = {}  # checkpoint -> the position its state is at
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
                  state_slots: int = 1, window_blocks: int = 0, checkpoints: int = 0) -> KVCache:
        """The cache `model` computes over (its kv_spec, and one plane for latent attention; a hybrid model's
        state pool of `state_slots` slots and `checkpoints` checkpoint slots; with `window_blocks`, a
        mixed-window model's two layer groups)."""
        state = getattr(model, "state_spec", None)
        return cls(*model.kv_spec, block_size, num_blocks, dtype, device, planes=model.kv_planes, state=state,
                   state_slots=state_slots if state is not None else 0,
                   linear_layers=tuple(getattr(model, "linear_layers", ())),
                   window_layers=mixed_window(model)[1] if window_blocks else (), window_blocks=window_blocks,
                   checkpoints=checkpoints)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.tensor, self.window_tensor, self.conv_state, self.rec_state) if t is not None)

    def copy_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A host copy of these blocks of every layer ([layers, planes, blocks, ...] per group): an id -2 - b is
        the window group's block b (engine.block_manager.BlockManager.held_blocks)."""
        ids = torch.tensor(sorted(set(blocks)), dtype=torch.long)
        return ids, [t[:, :, i.to(self.device)].cpu() for t, i in self._by_group(ids)]

    def put_blocks(self, ids: torch.Tensor, kept: list[torch.Tensor]) -> None:
        """Write back what copy_blocks took (after a re-allocation)."""
        for (t, i), k in zip(self._by_group(ids), kept, strict=True):
            t[:, :, i.to(self.device)] = k.to(self.device)

    def _by_group(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, its block ids) per layer group: -2 - b is the window group's block b."""
        groups = [(self.tensor, ids[ids >= 0])]
        if self.window_tensor is not None:
            groups.append((self.window_tensor, -2 - ids[ids < 0]))
        return groups

    def reset_state(self, slots: list[int]) -> None:
        """Zero these slots' state in every linear layer (a sequence computed from position 0)."""
        if self.conv_state is not None and slots:
            idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
            self.conv_state[:, idx] = 0
            self.rec_state[:, idx] = 0

    def save_checkpoint(self, slot: int, checkpoint: int, position: int) -> None:
        """Copy running slot `slot`'s state (at `position`) into `checkpoint`, in every linear layer."""
        i = self.state_slots + checkpoint
        self.conv_state[:, i] = self.conv_state[:, slot]
        self.rec_state[:, i] = self.rec_state[:, slot]
        self.checkpoint_pos[checkpoint] = position

    def load_checkpoint(self, slot: int, checkpoint: int) -> int | None:
        """Copy `checkpoint` into running slot `slot`; returns its position (None: it holds nothing)."""
        i = self.state_slots + checkpoint
        self.conv_state[:, slot] = self.conv_state[:, i]
        self.rec_state[:, slot] = self.rec_state[:, i]
        return self.checkpoint_pos.get(checkpoint)

    def allocate(self) -> None:
        # Zero-filled, not uninitialised: padded decode rows read unused slots, which must be finite.
        # On the host, an anonymous mapping (zero-filled by the kernel), which goes back to the OS the moment
        # the cache is released (sleep); faulted in whole now, at start and at wake, as an accelerator's cache
        # is allocated whole (ascend_ops.platform.populate_host_tensor: else decode steps pay for it).
        self.tensor = self._zeros(self.shape)
        last = self.shape[1] - 1  # (K, V), or (plane, plane)
        self.views = [(self.tensor[i, 0], self.tensor[i, last]) for i in range(self.shape[0])]
        if self.window_shape is not None:
            self.window_tensor = self._zeros(self.window_shape)
            full, win = iter(self.views), iter((t[0], t[last]) for t in self.window_tensor)
            total = self.shape[0] + self.window_shape[0]
            self.views = [next(win) if i in self.window_layers else next(full) for i in range(total)]
        if self.state_spec is not None:
            st, n = self.state_spec, self.state_slots + self.checkpoints
            self.checkpoint_pos = {}
            self.conv_state = torch.zeros((st.num_layers, n, *st.conv), dtype=self.dtype, device=self.device)
            self.rec_state = torch.zeros((st.num_layers, n, *st.recurrent), dtype=torch.float32, device=self.device)
            attn, lin = iter(self.views), iter(zip(self.conv_state, self.rec_state))
            total = self.shape[0] + st.num_layers
            self.views = [next(lin) if i in self.linear_layers else next(attn) for i in range(total)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        numel = 1
        for d in shape:
            numel *= d
        t = releasable_host_tensor(numel, self.dtype).view(shape)
        populate_host_tensor(t)
        return t

    def release(self) -> None:
        self.checkpoint_pos = {}
        self.views = []
        self.tensor = self.window_tensor = self.conv_state = self.rec_state = None


def mixed_window(model) -> tuple[int, tuple[int, ...]]:
    """A model whose attention layers mix full and sliding-window attention: (the largest window, the indexes
    of the windowed layers), its window group (engine.window_blocks); (0, ()) for any other model, a hybrid one
    included (its linear-attention layers keep state, not blocks)."""
    windows = tuple(getattr(getattr(model, "cfg", None), "windows", ()))
    if getattr(model, "state_spec", None) is not None or not any(windows) or all(windows):
        return 0, ()
    return max(windows), tuple(i for i, w in enumerate(windows) if w)


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


CHECKPOINT_SHARE = 4  # hybrid prefix caching: checkpoints take at most 1/4 of the blocks' share of the budget


def plan_checkpoints(num_blocks: int, *, bytes_per_block: int, bytes_per_slot: int, max_num_seqs: int,
                     min_blocks: int, extra: bool) -> tuple[int, int]:
    """A hybrid model's recurrent-state checkpoints for prefix caching (engine.state_checkpoints), out of the same
    budget: (checkpoints, blocks left). As many as --max-num-seqs, but at most a CHECKPOINT_SHARE-th of the
    blocks' bytes and never below `min_blocks` blocks (one --max-model-len sequence); `extra`
    (--num-gpu-blocks-override, where the state pool is extra too): --max-num-seqs on top of the blocks.
    (0, num_blocks) when none fits: prefix caching is then off for the model."""
    if extra:
        return max_num_seqs, num_blocks
    room = min(num_blocks * bytes_per_block // CHECKPOINT_SHARE, max(0, num_blocks - min_blocks) * bytes_per_block)
    n = min(max_num_seqs, room // bytes_per_slot)
    return n, num_blocks - -(-n * bytes_per_slot // bytes_per_block)


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
