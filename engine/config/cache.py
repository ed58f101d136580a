"""The KV cache: block size, dtype, how much memory it gets, prefix caching and its event stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from engine.argv import Switch, human_int, json_object_type
from engine.kv_events import KVEventsConfig, parse_kv_events_config

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bfloat16 | float16 (workers.startup)
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 on accelerators, a 1 GiB KV cache on CPU
    enable_prefix_caching: bool = True
    in_batch_prefix_sharing: bool | None = None  # None: on with the prefix cache (engine.scheduler.policy)
    mamba_block_size: int | None = None  # vLLM's: hybrid models checkpoint their state every N prompt tokens too
    kv_events_config: KVEventsConfig | None = None  # vLLM's (engine.kv_events, docs/fleet.md); None: no flag


def check(cache: CacheConfig) -> None:
    """ValueError naming what --mamba-block-size or --in-batch-prefix-sharing cannot be with the other cache
    flags."""
    if cache.in_batch_prefix_sharing and not cache.enable_prefix_caching:
        raise ValueError("--in-batch-prefix-sharing shares prompt blocks through the prefix cache; "
                         "--no-enable-prefix-caching turns that cache off")
    n = cache.mamba_block_size
    if n is None:
        return
    if not cache.enable_prefix_caching:
        raise ValueError("--mamba-block-size sets where hybrid models checkpoint their state for prefix caching; "
                         "--no-enable-prefix-caching turns that cache off")
    if n <= 0 or n % cache.block_size:
        raise ValueError(f"--mamba-block-size {n} must be a positive multiple of --block-size {cache.block_size}")


def prefix_caching_on(cache: CacheConfig, state_slots: int, state_checkpoints: int) -> bool:
    """Whether the engine caches prefixes: as the flag says, except for a hybrid model (one whose workers hold
    recurrent-state slots) whose workers have no room for recurrent-state checkpoints (engine.state_checkpoints):
    a prefix hit could not be resumed there. The scheduler acts on it and /server_info reports it."""
    return cache.enable_prefix_caching and (not state_slots or state_checkpoints > 0)


def in_batch_sharing_on(cache: CacheConfig, state_slots: int, state_checkpoints: int) -> bool:
    """Whether the scheduler defers a prompt whose uncached block another sequence is computing
    (--in-batch-prefix-sharing): on with the prefix cache unless the flag turns it off, never for a hybrid model
    (its prefix hits need a recurrent-state checkpoint at the hit's end). The scheduler acts on it and
    /server_info reports it."""
    return (prefix_caching_on(cache, state_slots, state_checkpoints) and not state_slots
            and cache.in_batch_prefix_sharing is not False)


JSON_FLAGS = {"kv_events_config": (parse_kv_events_config, lambda c: json.dumps(dataclasses.asdict(c)))}


def add_args(p: argparse.ArgumentParser) -> None:
    d = CacheConfig()
    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
    g.add_argument("--kv-cache-dtype", type=str.lower, default=d.kv_cache_dtype, metavar="{auto,bfloat16,float16}",
                   help="What the KV cache stores: auto, the model's dtype (the default); bfloat16 or float16, keys "
                        "and values rounded to 16 bits as they are written, half the bytes of an fp32 model's cache "
                        "(twice the tokens in the same memory, half the bytes each decode step reads); attention "
                        "still computes in the model's dtype. vLLM's fp8 and quantized caches are refused.")
    g.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                   help="Bytes of KV cache per worker (4G = 4 GiB, 4g = 4e9). Default on CPU: 1 GiB; on accelerators "
                        "--gpu-memory-utilization of the free memory after loading weights.")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use exactly this many KV blocks (testing and tuning).")
    g.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                   default=d.gpu_memory_utilization,
                   help="Fraction of device memory the engine may use (accelerators: default 0.9 of the memory "
                        "free after loading weights goes to the KV cache). On CPU, as vLLM's CPU backend, the "
                        "fraction of the host's total memory one worker may hold: the KV cache gets that less what "
                        "the worker holds after loading (weights, packed weights); unset on CPU: a 1 GiB cache. "
                        "--kv-cache-memory-bytes and VLLM_CPU_KVCACHE_SPACE win over it.")
    g.add_argument("--enable-prefix-caching", action=Switch, negatives=["--disable-prefix-caching"],
                   default=d.enable_prefix_caching,
                   help="Reuse KV blocks of identical prompt prefixes (keyed by weight version too).")
    g.add_argument("--in-batch-prefix-sharing", action=Switch, default=d.in_batch_prefix_sharing,
                   help="Requests that arrive together and share a prompt prefix (a system prompt; the n samples "
                        "of a GRPO group sent as separate requests) compute it once: a waiting request whose next "
                        "uncached prompt block another request is computing waits one step and then reuses it "
                        "from the prefix cache (SGLang's in-batch prefix caching). Costs those requests one step "
                        "of time to first token. Default: on with the prefix cache; --no-in-batch-prefix-sharing "
                        "turns it off. Refused with --no-enable-prefix-caching.")
    g.add_argument("--mamba-block-size", type=int, default=None,
                   help="Hybrid models (Qwen3-Next, Qwen3.5) with prefix caching: also checkpoint the Gated "
                        "DeltaNet state every N prompt tokens (a multiple of --block-size), so prompts that share "
                        "only a prefix (a system prompt) resume at its last multiple of N; each checkpoint costs "
                        "one sequence's recurrent state. Unset: only at each prompt's last full block. Refused "
                        "without prefix caching and for models without linear-attention layers.")
    g.add_argument("--kv-events-config", type=json_object_type("--kv-events-config"), default=None,
                   help='JSON object, vLLM\'s KVEventsConfig: {"enable_kv_cache_events": true, "endpoint": '
                        '"tcp://*:5557"} publishes the prefix cache\'s BlockStored / BlockRemoved / '
                        "AllBlocksCleared events in vLLM's format on that ZeroMQ PUB endpoint (engine N of "
                        "-dp publishes on port + N), for a KV-aware router (docs/fleet.md). Other keys: "
                        "publisher (zmq | null), replay_endpoint, buffer_steps, hwm, max_queue_size, topic. "
                        "Needs the prefix cache on.")


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of device memory
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU backend: KV cache GiB, over --kv-cache-memory-bytes


def cpu_kv_space_bytes(environ: dict[str, str]) -> int | None:
    """vLLM's legacy CPU setting: VLLM_CPU_KVCACHE_SPACE=N (GiB) sets the KV bytes of every CPU worker and
    wins over --kv-cache-memory-bytes, as vLLM's CpuPlatform; unset or empty: None. ValueError names it."""
    raw = environ.get(CPU_KV_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = int(raw)
    except ValueError:
        raise ValueError(f"{CPU_KV_SPACE_ENV} must be a whole number of GiB, got {raw!r}") from None
    if gib <= 0:
        raise ValueError(f"{CPU_KV_SPACE_ENV} must be a positive number of GiB, got {gib}")
    return gib << 30
