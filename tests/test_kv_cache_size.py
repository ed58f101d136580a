"""How many KV blocks a worker sizes: vLLM's CPU setting VLLM_CPU_KVCACHE_SPACE (GiB) wins over
--kv-cache-memory-bytes on CPU, as vLLM's CpuPlatform; a bad value stops the start-up naming it."""

from __future__ import annotations

import re

import pytest

from ascend_ops.platform import current_platform
from engine.config import parse_config
from workers.kv_cache import CPU_DEFAULT_KV_BYTES, plan_num_blocks

pytestmark = pytest.mark.unit
BLOCK = 1 << 20


def blocks(kv_bytes: int | None = None) -> int:
    return plan_num_blocks(current_platform(), bytes_per_block=BLOCK, kv_cache_memory_bytes=kv_bytes,
                           num_blocks_override=None, gpu_memory_utilization=0.9, device_index=0)


def test_the_cpu_default_and_the_flag(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert blocks() == CPU_DEFAULT_KV_BYTES // BLOCK
    assert blocks(64 * BLOCK) == 64


def test_vllm_cpu_kvcache_space_is_gib_and_wins_over_the_flag(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert blocks() == 3 * 1024
    assert blocks(64 * BLOCK) == 3 * 1024
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # empty: unset, as vLLM
    assert blocks(64 * BLOCK) == 64


@pytest.mark.parametrize("value, words", [("4G", "a whole number of GiB, got '4G'"),
                                          ("0", "a positive number of GiB, got 0"),
                                          ("-2", "a positive number of GiB, got -2")])
def test_a_bad_value_stops_the_start_up_naming_it(monkeypatch, value, words):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(SystemExit, match=re.escape(f"VLLM_CPU_KVCACHE_SPACE must be {words}")):
        parse_config([])
