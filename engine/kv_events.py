"""KV cache events (vLLM's `--kv-events-config`): what the prefix cache stored and dropped, for a router
(vllm-router's `kv_aware` policy) that sends a conversation back to the engine holding its prefix. Pure:
the config, the wire structs and their encoding; the scheduler's publisher owns the sockets.

The wire is vLLM's (vllm/distributed/kv_events.py): every batch is one ZeroMQ message of three frames,
`[topic, seq (8 bytes, big-endian), msgpack(EventBatch)]`, seq counting from 0 per publisher. EventBatch
is a positional array `[ts, events, data_parallel_rank]`; each event is a map tagged by its class name
under "type" (msgspec `tag=True`), with the fields that have defaults left out when they hold them:

    {"type": "BlockStored", "block_hashes": [h...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [h...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block hashes are the scheduler's own prefix-cache keys as unsigned 64-bit integers (vLLM's
ExternalBlockHash is bytes or int): opaque to a consumer, which uses them to chain a block to its parent
and to find what a BlockRemoved drops; the router keys its index by the token ids. "GPU" is vLLM's name
for the engine's primary KV cache, whatever the device (vLLM's CPU backend says "GPU" too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.argv import json_object_flag

MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the primary KV cache tier
HASH_MASK = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (the tag is the class name, under "type")."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: list[KVCacheEvent], data_parallel_rank: int | None, ts: float | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, events, data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """For tests and consumers in Python: the typed batch (msgspec.DecodeError on anything else)."""
    return _decoder.decode(payload)


def external_hash(h: int) -> int:
    """A prefix-cache key as the unsigned 64-bit integer the events carry (consumers refuse negatives)."""
    return h & HASH_MASK


# --------------------------------------------------------------------------------------- the config

_DEFAULTS: dict[str, Any] = {"enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557",
                             "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000,
                             "max_queue_size": 100_000, "topic": ""}


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, same keys, same defaults. `publisher` "zmq" publishes, "null" does not."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def endpoints_for(self, data_parallel_rank: int) -> tuple[str, str | None]:
        """vLLM's offset_endpoint_port: engine N of a data-parallel deployment publishes on port + N."""
        return offset_endpoint(self.endpoint, data_parallel_rank), offset_endpoint(self.replay_endpoint,
                                                                                   data_parallel_rank)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"  # ipc://: a path, suffixed like inproc (vLLM refuses these with dp > 1)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, an ipc:// or an inproc:// endpoint is bound; anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """None when the flag is absent; ValueError (a start-up error naming the flag) for anything invalid."""
    raw = json_object_flag("--kv-events-config", text, _DEFAULTS, '{"enable_kv_cache_events": true}')
    if raw is None:
        return None
    v = {**_DEFAULTS, **raw}
    if not isinstance(v["enable_kv_cache_events"], bool):
        raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
    if v["publisher"] is None:
        v["publisher"] = "zmq" if v["enable_kv_cache_events"] else "null"
    if v["publisher"] not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown event publisher {v['publisher']!r}; known: null, zmq")
    for key in ("endpoint", "topic"):
        if not isinstance(v[key], str):
            raise ValueError(f"--kv-events-config: {key} must be a string")
    if v["replay_endpoint"] is not None and not isinstance(v["replay_endpoint"], str):
        raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
    for key in ("endpoint", "replay_endpoint"):
        ep = v[key]
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: {key} {ep!r} is not a ZeroMQ endpoint (tcp://, ipc:// or inproc://)")
    if v["replay_endpoint"] is not None and not binds(v["replay_endpoint"]):
        raise ValueError(f"--kv-events-config: replay_endpoint {v['replay_endpoint']!r} must be one this engine binds "
                         "(a wildcard host such as tcp://*:5558, or ipc://)")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] <= 0:
            raise ValueError(f"--kv-events-config: {key} must be a positive integer, got {v[key]!r}")
    return KVEventsConfig(**v)
