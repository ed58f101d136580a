"""How many KV blocks a worker sizes: vLLM's CPU setting VLLM_CPU_KVCACHE_SPACE (GiB) wins over
--kv-cache-memory-bytes on CPU, as vLLM's CpuPlatform; on CPU --gpu-memory-utilization is the fraction of the
host's memory one worker may hold (vLLM's CPU worker); a bad value stops the start-up naming it."""

from __future__ import annotations

import re

import pytest

from ascend_ops.platform import current_platform, host_total_bytes, process_resident_bytes
from engine.config import parse_config
from workers.kv_cache import CPU_DEFAULT_KV_BYTES, plan_num_blocks

pytestmark = pytest.mark.unit
BLOCK = 1 << 20


def blocks(kv_bytes: int | None = None, utilization: float | None = None) -> int:
    return plan_num_blocks(current_platform(), bytes_per_block=BLOCK, kv_cache_memory_bytes=kv_bytes,
                           num_blocks_override=None, gpu_memory_utilization=utilization, device_index=0)


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


def test_gpu_memory_utilization_on_cpu_is_the_workers_share_of_the_host(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    share = (process_resident_bytes() + (512 << 20)) / host_total_bytes()  # what we hold + 512 MiB
    got = blocks(utilization=share)
    expected = (int(host_total_bytes() * share) - process_resident_bytes()) // BLOCK
    assert abs(got - expected) <= 32 and 400 < got < 600, (got, expected)
    assert blocks(64 * BLOCK, utilization=share) == 64  # the byte budget wins, as in vLLM


def test_a_cpu_share_with_no_room_left_or_a_cache_beyond_the_host_is_refused_naming_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 1e-06 on CPU .* no room for a KV cache"):
        blocks(utilization=1e-6)
    with pytest.raises(ValueError, match=r"\(--kv-cache-memory-bytes\) does not fit the host's"):
        blocks(2 * host_total_bytes())


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_0_1_stops_the_start_up(value, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(SystemExit, match=re.escape(f"--gpu-memory-utilization must be in (0, 1], got {float(value)}")):
        parse_config(["--gpu-memory-utilization", value])
