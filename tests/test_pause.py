"""Pause and resume as acknowledged broadcasts, through the whole engine (vLLM v0.33 semantics)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server_helpers import start_server
from tests.waits import holds, wait_for

pytestmark = pytest.mark.timeout(300)
MODEL = "pause-tiny"
RL = '{"rl_config": {"enabled": true}}'
# Pause semantics do not depend on the weights: a tiny random llama with SmolLM2's tokenizer steps many
# times faster than SmolLM2 on CPU, so requests are long enough (in tokens) to be surely running when
# a pause arrives, and still finish quickly.
LONG = 300


# Every pause mode under both schedulers: with --async-scheduling a second step is in flight whenever a pause
# arrives, and the quiesce must wait for both.
@pytest.fixture(scope="module", params=["--no-async-scheduling", "--async-scheduling"])
def server(request, tmp_path_factory, smollm2_dir):
    from tests.server_helpers import tiny_model_with_tokenizer

    work = tmp_path_factory.mktemp("pause")
    folder = tiny_model_with_tokenizer("llama", work / "m", smollm2_dir, vocab_size=49152,
                                       max_position_embeddings=1024)
    s = start_server(work, str(folder), "--served-model-name", MODEL, "--additional-config", RL,
                     "--max-model-len", "1024", request.param)
    yield s
    s.stop()


def launch(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], dict[int, dict]]:
    out: dict[int, dict] = {}

    def go(i):
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0})
        out[i] = {"status": r.status_code, **r.json()}

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    return ts, out


def answered(ts: list[threading.Thread], out: dict[int, dict], n: int, timeout_s: float = 300) -> None:
    """Join the request threads; every one of the n requests got its response (a thread that died of a
    timeout leaves no entry, and checks over out.values() would then pass on nothing)."""
    for t in ts:
        t.join(timeout_s)
    assert len(out) == n, f"{n - len(out)} of {n} requests got no response"


def wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running"))
        if float(line.rsplit(" ", 1)[1]) >= n:
            return
        time.sleep(0.05)
    raise AssertionError("requests never ran")


def wait_generated(url: str, n: int) -> None:
    """Until the engine has sampled n more tokens (its counter arrives with every step's outputs)."""
    base = _metric(url, "rollbus_engine_generation_tokens_total")
    wait_for(lambda: _metric(url, "rollbus_engine_generation_tokens_total") >= base + n, 60,
             f"{n} tokens sampled")


def post(url, path, **params):
    return httpx.post(url + path, params=params, timeout=120)


def test_abort_ends_requests_with_partial_output_and_refuses_new_ones(server):
    url = server.url
    ts, out = launch(url, 4, LONG)
    wait_running(url, 4)
    # "running" counts a request from the plan that admits it, before its first token: wait for a step
    # after that one, so that every request has output to be cut short
    wait_generated(url, 8)
    t0 = time.monotonic()
    r = post(url, "/pause", mode="abort")
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    assert time.monotonic() - t0 < 2
    answered(ts, out, 4)
    for o in out.values():
        assert o["choices"][0]["finish_reason"] == "abort"
        assert 0 < o["usage"]["completion_tokens"] < LONG
    assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
    refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]
    assert post(url, "/pause", mode="abort").status_code == 200  # twice: no-op
    assert post(url, "/resume").json() == {"status": "resumed"}
    assert post(url, "/resume").status_code == 200  # resume when running: no-op
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_keep_freezes_requests_which_finish_after_resume(server):
    url = server.url
    ts, out = launch(url, 3, LONG)
    wait_running(url, 3)
    assert post(url, "/pause", mode="keep", clear_cache="true").status_code == 200
    steps = _metric(url, "rollbus_step_latency_seconds_count")  # arrives with every step's outputs
    late_ts, late = launch(url, 1, 5)  # keep queues new requests instead of refusing them
    # nothing observable says the late request reached the scheduler: watch a window for any step
    holds(lambda: not late and _metric(url, "rollbus_step_latency_seconds_count") == steps, 1.5,
          "nothing is stepped while kept")
    assert post(url, "/resume").status_code == 200
    answered(ts, out, 3)
    answered(late_ts, late, 1)
    assert all(o["choices"][0]["finish_reason"] == "length" and o["usage"]["completion_tokens"] == LONG
               for o in out.values())
    assert late[0]["status"] == 200


def test_keep_with_recompute_gives_the_same_greedy_tokens(server):
    """clear_cache=true drops the kept requests' KV; recomputed after resume, greedy output is unchanged
    (same weights), which shows the recompute path is exact."""
    url = server.url
    # 800 tokens: on a fast host 200 could all be sampled between wait_running and wait_generated's first read
    ref = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Story number 0:", "max_tokens": 800, "ignore_eos": True, "temperature": 0})
    ts, out = launch(url, 1, 800)
    wait_running(url, 1)
    wait_generated(url, 10)  # the recompute then covers sampled tokens, not only the prompt
    assert post(url, "/pause", mode="keep", clear_cache="true").status_code == 200
    assert post(url, "/resume").status_code == 200
    answered(ts, out, 1)
    assert out[0]["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_wait_returns_after_running_requests_finish(server):
    url = server.url
    ts, out = launch(url, 3, 300)  # long enough to be seen running (40 could finish between two polls)
    wait_running(url, 3)
    r = post(url, "/pause", mode="wait")
    assert r.status_code == 200
    assert len(out) == 3 or all(not t.is_alive() for t in ts) or _metric(url, "vllm:num_requests_running") == 0
    answered(ts, out, 3)
    assert all(o["choices"][0]["finish_reason"] == "length" for o in out.values())
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 503
    assert post(url, "/resume").status_code == 200


def test_bad_pause_parameters(server):
    url = server.url
    for params, field in (({"mode": "later"}, "mode"), ({"clear_cache": "maybe"}, "clear_cache"),
                          ({"timeout": "-1"}, "timeout"), ({"timeout": "2e-289"}, "timeout"),
                          ({"timeout": "nan"}, "timeout"), ({"timeout": "1e999"}, "timeout")):
        r = post(url, "/pause", **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}


def test_server_info_shows_the_effective_rl_config(server):
    info = httpx.get(server.url + "/server_info").json()
    assert info["rl_config"]["enabled"] is True and info["ascend_config"]["weight_nz_mode"] == 0


def test_dev_endpoints_are_404_outside_rl_mode(tmp_path, smollm2_dir):
    from tests.server_helpers import tiny_model_with_tokenizer

    folder = tiny_model_with_tokenizer("llama", tmp_path / "m", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256")
    try:
        for path in ("/pause", "/resume"):
            assert httpx.post(s.url + path).status_code == 404
        assert httpx.get(s.url + "/is_paused").status_code == 404
    finally:
        s.stop()


def _metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


SPANNED = 900  # tokens of a request a keep pause cuts in two: long enough not to finish before the pause lands


def _versions(url, **extra):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Story number 7:", "max_tokens": SPANNED, "ignore_eos": True, "temperature": 0,
        "return_weight_versions": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("clear_cache", ["true", "false"])
def test_weight_version_spans_across_a_keep_pause(server, clear_cache):
    url = server.url
    assert httpx.post(url + "/update_weight_version", json={"new_version": "v1"}).json() == \
        {"success": True, "new_version": "v1"}
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "v1"}
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(_versions(url)))
    t.start()
    wait_running(url, 1)
    wait_generated(url, 5)  # some tokens under v1 before the pause
    assert post(url, "/pause", mode="keep", clear_cache=clear_cache).status_code == 200
    assert httpx.post(url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200
    assert post(url, "/resume").status_code == 200
    t.join(120)
    spans = got["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == SPANNED
    # clear_cache=false keeps KV computed under v1: the v2 tokens say so
    assert spans[1].get("stale_kv", False) is (clear_cache == "false")


def test_prefix_cache_is_not_reused_across_weight_versions(server):
    url = server.url
    prompt = "A long shared prefix for caching. " * 10
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    httpx.post(url + "/v1/completions", json=body, timeout=60)
    again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(url + "/update_weight_version", json={"new_version": "v9"}).status_code == 200
    after = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for bad in ({}, {"new_version": 3}, {"new_version": ""}):
        r = httpx.post(url + "/update_weight_version", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "new_version"


def test_a_member_that_misses_the_deadline_makes_the_call_fail_with_504(tmp_path, smollm2_dir):
    import os
    import signal as sig

    from tests.server_helpers import tiny_model_with_tokenizer

    folder = tiny_model_with_tokenizer("llama", tmp_path / "m", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256", "--additional-config", RL,
                     "--control-timeout-s", "1")
    worker = s.child_pids()["worker-0"]
    try:
        os.kill(worker, sig.SIGSTOP)
        r = httpx.post(s.url + "/pause", timeout=30)
        assert r.status_code == 504 and "worker-0" in r.json()["error"]["message"], r.text
    finally:
        os.kill(worker, sig.SIGCONT)
        s.stop()
