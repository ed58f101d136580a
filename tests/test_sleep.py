"""Sleep mode through the whole engine: memory really goes back, and the level-2 recipe works."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.procstats import mapping_rss, rss
from tests.server_helpers import start_server
from tests.waits import holds

pytestmark = pytest.mark.timeout(300)
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KV_BYTES = 256 << 20
WEIGHT_BYTES = 134_515_008 * 4  # SmolLM2-135M in fp32


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    s = start_server(tmp_path_factory.mktemp("sleep"), "--additional-config", '{"rl_config": {"enabled": true}}',
                     "--enable-sleep-mode", "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", "1024")
    yield s
    s.stop()


def kv_resident(pid: int) -> int:
    """Resident bytes of the worker's KV cache: it is faulted in lazily, so only used pages count."""
    return mapping_rss(pid, KV_BYTES)


def greedy(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The three laws of motion are", "max_tokens": 24, "temperature": 0,
        "logprobs": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"text": c["text"], "lp": c["logprobs"]["token_logprobs"], "top": c["logprobs"]["top_logprobs"]}


def post(url, path, params=None, **kw):
    return httpx.post(url + path, params=params, timeout=120, **kw)


def sleep_gauge(url: str) -> str:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state") and float(line.rsplit(" ", 1)[1]) == 1:
            return line.split('sleep_state="')[1].split('"')[0]
    raise AssertionError("no sleep gauge")


def test_level1_round_trip_is_bitwise_identical_and_frees_the_kv_cache(server):
    url, worker = server.url, server.child_pids()["worker-0"]
    before = greedy(url)
    rss_awake, kv_awake = rss(worker), kv_resident(worker)
    assert kv_awake > 0
    r = post(url, "/sleep", {"level": 1})
    assert r.status_code == 200 and r.json()["status"] == "sleeping" and r.json()["level"] == 1
    assert r.json()["released_bytes"] >= 0.99 * KV_BYTES  # on CPU the weights stay: the host is the device
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_gauge(url) == "weights_offloaded"
    assert rss_awake - rss(worker) > 0.9 * kv_awake and kv_resident(worker) == 0
    w = post(url, "/wake_up")
    assert w.json()["status"] == "awake"
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_gauge(url) == "awake"
    assert greedy(url) == before  # text, logprobs and top-k alternatives, bit for bit


def test_level2_recipe_and_requests_queue_while_asleep(server):
    url, worker = server.url, server.child_pids()["worker-0"]
    before = greedy(url)
    rss_awake, kv_awake = rss(worker), kv_resident(worker)
    r = post(url, "/sleep", {"level": 2})
    assert r.json()["released_bytes"] >= 0.9 * (KV_BYTES + WEIGHT_BYTES)
    freed = rss_awake - rss(worker)
    held = kv_awake + WEIGHT_BYTES  # what weights and KV actually held in RAM
    assert freed > 0.9 * held, f"RSS dropped by {freed / 2**20:.0f} MiB of {held / 2**20:.0f} MiB"
    assert sleep_gauge(url) == "discard_all"
    # a request sent while asleep queues (no 503) and runs after the wake
    queued: dict = {}
    t = threading.Thread(target=lambda: queued.update(greedy(url)))
    t.start()
    holds(lambda: not queued, 0.5, "queued while asleep")  # no event says the request reached the scheduler
    assert post(url, "/wake_up", {"tags": "weights"}).json()["status"] == "sleeping"
    rpc = post(url, "/collective_rpc", json={"method": "reload_weights"})
    assert rpc.status_code == 200 and rpc.json()["results"][0]["loaded_tensors"] > 0
    assert post(url, "/wake_up", {"tags": "kv_cache"}).json()["status"] == "awake"
    t.join(120)
    assert queued == before
    assert greedy(url) == before


# slow lane (CI time, ~19 s): five sleep / wake cycles to see memory pile up; the level 1 and 2 round trips above
# run the same path once each in CI
@pytest.mark.slow
def test_memory_returns_to_where_it_started_over_cycles(server):
    url, worker = server.url, server.child_pids()["worker-0"]
    greedy(url)
    start = rss(worker)
    asleep, awake = [], []
    for _ in range(5):
        post(url, "/sleep", {"level": 2})
        asleep.append(rss(worker))  # after the sleep's malloc_trim: what the process keeps
        post(url, "/wake_up", {"tags": "weights"})
        post(url, "/collective_rpc", json={"method": "reload_weights"})
        post(url, "/wake_up", {"tags": "kv_cache"})
        greedy(url)
        awake.append(rss(worker))
    mib = [round(b / 2**20) for b in (start, *asleep, *awake)]
    # asleep, nothing may pile up from one cycle to the next (the packed copies of the weights once stayed
    # resident in some cycles: 721 MiB asleep against 337 in others; workers/sleep.py drops them first)
    assert max(asleep) - min(asleep) < 0.02 * start, mib
    # awake, a step's freed blocks may still sit in the heap when RSS is read (measured: about one cycle in
    # ten reads ~110 MiB above the others, and the next cycle is back), so a leak is growth in the last two
    assert abs(min(awake[-2:]) - start) < 0.05 * start, mib


def test_bad_sleep_input_is_400_and_noops_are_200(server):
    url = server.url
    for path, params, field in (("/sleep", {"level": 3}, "level"), ("/sleep", {"level": "x"}, "level"),
                                ("/sleep", {"mode": "soon"}, "mode"), ("/wake_up", {"tags": "gpu"}, "tags")):
        r = post(url, path, params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, params, r.text)
    r = post(url, "/collective_rpc", json={"method": "__init__"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "method"
    assert post(url, "/collective_rpc", content=b"[1]").status_code == 400
    assert post(url, "/wake_up").status_code == 200  # awake already: no-op
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    greedy(url)


def test_sleep_needs_the_flag(tmp_path, smollm2_dir):
    from tests.server_helpers import tiny_model_with_tokenizer

    folder = tiny_model_with_tokenizer("llama", tmp_path / "m", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256", "--additional-config",
                     '{"rl_config": {"enabled": true}}')
    try:
        r = httpx.post(s.url + "/sleep", params={"level": 1})
        assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
    finally:
        s.stop()
