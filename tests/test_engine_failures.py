"""Bad input never crashes a process or loses a request; a dead process is noticed and everything
stops cleanly. Real processes, real sockets."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.gateway_bad_inputs import bad_input_cases
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory, smollm2_dir):
    # SmolLM2's tokenizer and chat template (what the bad inputs go through) on a tiny random llama of the
    # same vocabulary: the 200 cases generate tokens in a fraction of SmolLM2's time
    work = tmp_path_factory.mktemp("serve")
    folder = tiny_model_with_tokenizer("llama", work / "m", smollm2_dir, vocab_size=49152)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--enable-scale-out", "--enable-trace-replay", "--max-prompts-per-request", "8",
                     "--max-prompt-tokens-per-request", "1000", "--max-request-body-bytes", "65536")
    yield s
    s.stop()


def test_bad_inputs_get_4xx_envelopes_and_the_engine_keeps_serving(smol_server, smollm2_dir):
    tiny_server = smol_server
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cases = bad_input_cases(max_model_len=256, vocab_size=cfg["vocab_size"], max_logprobs=20, scale_out=True,
                            max_prompts=8, max_prompt_tokens=1000, max_body_bytes=65536)
    assert len(cases) >= 20
    with httpx.Client(base_url=tiny_server.url, timeout=60) as h:
        for case in cases:
            body = case.body
            if isinstance(body, dict) and "model" not in body:
                body = {"model": "tiny", **body}
            if isinstance(body, (bytes, str)) and not isinstance(body, bytes):
                body = json.dumps(body).encode()
            if isinstance(body, bytes):
                r = h.post(case.path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(case.path, json=body)
            assert r.status_code == case.status, (case.description, r.status_code, r.text)
            if case.status >= 400:
                err = r.json()["error"]
                assert set(err) >= {"message", "type", "param", "code"}, case.description
                assert err["message"], case.description
                if case.param:
                    assert err["param"] == case.param, (case.description, err)
        ok = h.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5,
                                             "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        ok = h.post("/inference/v1/generate", json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    assert tiny_server.proc.poll() is None


def test_preemption_under_a_small_kv_cache_keeps_outputs_exact(tmp_path, smollm2_dir):
    """16 blocks of 16 tokens for 8 requests of ~100 tokens: requests are preempted and recomputed,
    and greedy outputs equal those of a server with room to spare."""
    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(30 + i)] for i in range(8)]

    def run(*extra):
        s = start_server(tmp_path, str(folder), "--max-model-len", "256", *extra)
        try:
            out: dict[int, list[int]] = {}

            def go(i):
                r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                    "model": str(folder), "prompt": prompts[i], "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
                out[i] = r.json()["choices"][0]["logprobs"]["tokens"]

            ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(180)
            return out, metric(s, "vllm:num_preemptions_total")
        finally:
            s.stop()

    roomy, _ = run()
    tight, preempted = run("--num-gpu-blocks-override", "16", "--max-model-len", "256")
    assert preempted > 0
    assert tight == roomy


def test_dead_worker_fails_in_flight_requests_and_stops_everything(tmp_path, smollm2_dir):
    """With --max-restarts 0 a death is the end (the default restarts the worker: tests/test_recovery.py)."""
    folder = tiny_model_with_tokenizer("llama", tmp_path / "llama", smollm2_dir)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256", "--max-restarts", "0")
    pids = s.child_pids()
    assert set(pids) == {"coordinator", "scheduler", "worker-0", "gateway"}, pids
    result: dict = {}
    answered = threading.Event()

    def stream():
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                    "model": str(folder), "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as r:
                answered.set()  # the gateway took the request: it is being submitted to the engine
                result["lines"] = [ln for ln in r.iter_lines() if ln]
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        result["elapsed"] = time.monotonic() - t0

    # slow the worker down so the request is surely in flight when it dies
    os.kill(pids["worker-0"], signal.SIGSTOP)
    th = threading.Thread(target=stream)
    th.start()
    assert answered.wait(30), result
    os.kill(pids["worker-0"], signal.SIGKILL)
    th.join(30)
    assert not th.is_alive(), "request hung after the worker died"
    assert result["elapsed"] < 15
    # the stream ends with an error event (or the connection breaks): never a clean finish. Parsed, not grepped:
    # generated text may contain the word "error"
    events = [json.loads(ln.removeprefix("data: ")) for ln in result.get("lines", [])
              if ln.startswith("data: {")]
    assert "error" in result or any("error" in e for e in events), result
    assert not any(c.get("finish_reason") in ("stop", "length") for e in events for c in e.get("choices", [])), events
    # the launcher notices, stops every process and exits non-zero; no orphans
    assert s.proc.wait(30) != 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values()), s.child_pids()
    assert "worker-0" in s.log()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_an_undecodable_message_on_the_ready_socket_is_logged_and_serving_goes_on(smol_server):
    """The launcher's ready socket (where children report Ready) logs a message it cannot decode, e.g. from a
    child of another rollbus version, instead of dropping it silently, and keeps supervising."""
    import zmq

    pid = next(iter(smol_server.child_pids().values()))
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0")]
    endpoint = argv[argv.index("--ready-endpoint") + 1]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send_multipart([b"not", b"a rollbus message"])
    sock.close()
    deadline = time.monotonic() + 30
    while "undecodable message on the ready socket" not in smol_server.log():
        assert time.monotonic() < deadline, smol_server.log()[-2000:]
        time.sleep(0.1)
    r = httpx.post(smol_server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200, r.text
