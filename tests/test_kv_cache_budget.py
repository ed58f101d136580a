"""--gpu-memory-utilization on a CPU worker, end to end: the KV cache a real worker sizes and commits, and a
share that leaves no room stopping the start-up with the flag named (tests/test_kv_cache_size.py has the
arithmetic)."""

from __future__ import annotations

import httpx
import pytest

from ascend_ops.platform import host_total_bytes
from tests.server_helpers import start_server, tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return tiny_model_with_tokenizer("llama", tmp_path_factory.mktemp("tiny") / "llama", smollm2_dir)


def test_a_cpu_share_sizes_the_cache_and_one_with_no_room_stops_the_start_up(tmp_path, tiny, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # /server_info
    # 512 MiB of the host for the worker: weights + packs + KV (a bigger share only costs start-up time: a
    # host whose fresh memory faults in slowly took 9 s to populate a 1 GiB cache)
    share = (512 << 20) / host_total_bytes()
    server = start_server(tmp_path, str(tiny), "--gpu-memory-utilization", f"{share:.6f}")
    try:
        worker = httpx.get(server.url + "/server_info").json()["workers"]["worker-0"]
        # the KV cache is the share less what the worker held after loading (a tiny model: under 1 GiB)
        assert 32 << 20 < worker["kv_cache_bytes"] < 512 << 20, worker
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match=r"--gpu-memory-utilization 1e-06 on CPU .* no room for a KV cache"):
        start_server(tmp_path, str(tiny), "--gpu-memory-utilization", "0.000001", timeout_s=120)
