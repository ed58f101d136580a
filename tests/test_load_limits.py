"""Load limits and graceful stop (issue 11): --max-num-queued-reqs (503 + Retry-After), the body-size
limit (413 before parsing, chunked bodies too), and SIGTERM draining (new requests 503, running ones
finish within --shutdown-timeout or are aborted with an error and [DONE], exit 0, no process left; a
second signal stops at once). The request-limit 400s are rows of tests/gateway_bad_inputs.py."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest

from gateway.limits import DRAINING_MESSAGE, OVERLOADED_MESSAGE, Admission, LoadLimitMiddleware, Overloaded
from tests.procstats import rss
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from tests.waits import wait_for

RL = '{"rl_config": {"enabled": true}}'
MODEL = "tiny"


# --- the policy, over ASGI directly -------------------------------------------------------------------


def _asgi_call(mw: LoadLimitMiddleware, path: str, body: bytes = b"", headers: list | None = None,
               chunks: list[bytes] | None = None) -> tuple[asyncio.Task, list[dict]]:
    sent: list[dict] = []
    parts = list(chunks) if chunks is not None else [body]
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers or []}

    async def receive() -> dict:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
        await asyncio.Event().wait()  # no disconnect while the test runs
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    return asyncio.ensure_future(mw(scope, receive, send)), sent


async def wait_until(pred, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0)
    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.unit
def test_admission_counts_sequences_and_releases_them_however_the_request_ends():
    async def main() -> None:
        admission = Admission(3)
        gates: dict[str, asyncio.Event] = {}

        async def app(scope, receive, send):  # a handler: admits one sequence, then runs until its gate opens
            while (await receive()).get("more_body"):
                pass
            admission.admit(scope, 1)
            gate = gates.setdefault(scope["headers"][0][1].decode(), asyncio.Event())
            await gate.wait()
            if scope["headers"][0][1] == b"fail":
                raise RuntimeError("handler failed")

        mw = LoadLimitMiddleware(app, admission, max_body_bytes=100)
        a, _ = _asgi_call(mw, "/v1/completions", headers=[(b"x-id", b"a")])
        b, _ = _asgi_call(mw, "/v1/completions", headers=[(b"x-id", b"fail")])
        await wait_until(lambda: admission.sequences == 2)
        assert admission.sequences == 2 and admission.requests == 2
        with pytest.raises(Overloaded):  # 2 + 2 > 3
            admission.admit({}, 2)
        gates["fail"].set()
        with pytest.raises(RuntimeError):
            await b
        assert admission.sequences == 1 and admission.requests == 1  # released although the handler raised
        admission.draining = True
        with pytest.raises(Overloaded, match="shutting down"):
            admission.admit({}, 1)
        assert not admission.idle.is_set()
        gates["a"].set()
        await a
        assert admission.sequences == 0 and admission.idle.is_set()

    asyncio.run(main())


@pytest.mark.unit
def test_body_limit_by_content_length_and_by_counting_a_chunked_body():
    async def main() -> None:
        reached = []

        async def app(scope, receive, send):
            while (await receive()).get("more_body"):
                pass
            reached.append(scope["path"])

        mw = LoadLimitMiddleware(app, Admission(10), max_body_bytes=10)
        t, sent = _asgi_call(mw, "/pause", headers=[(b"content-length", b"11")])
        await t
        assert sent[0]["status"] == 413 and not reached  # refused before the app saw it
        t, sent = _asgi_call(mw, "/v1/completions", chunks=[b"12345", b"67890", b"1"])
        from gateway.limits import BodyTooLarge

        with pytest.raises(BodyTooLarge):  # the app's handler turns it into 413
            await t
        t, sent = _asgi_call(mw, "/v1/completions", chunks=[b"12345", b"67890"])
        await t
        assert reached == ["/v1/completions"]

    asyncio.run(main())


@pytest.mark.unit
def test_prefill_backlog_counts_prompts_until_their_first_output():
    admission = Admission(100, max_queued_tokens=10)
    a, b = {}, {}
    admission.admit(a, 2, prompt_tokens=12)  # below the limit when it came: admitted, as in vLLM
    with pytest.raises(Overloaded) as e:  # the backlog (12) has reached the limit (10)
        admission.admit(b, 1, prompt_tokens=1)
    assert e.value.reason == "max_num_queued_tokens" and e.value.headers == {"Retry-After": "1"}
    admission.prefilled(a, 6)  # one of the two choices produced output: 6 < 10 left
    admission.admit(b, 1, prompt_tokens=3)
    assert admission.queued_tokens == 9
    admission.prefilled(a, 6)
    assert admission.queued_tokens == 3
    admission._enter()
    admission._leave(b, counted=True)  # a request that ended before its first output gives its tokens back
    assert admission.queued_tokens == 0 and admission.sequences == 2


@pytest.mark.unit
def test_the_gateway_releases_the_backlog_and_counts_rejections_by_reason():
    from tests.test_gateway_protocol import make_app

    http, _ = make_app(max_num_queued_tokens=0)  # vLLM's rule: a backlog of 0 >= 0 refuses everything
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "prefill token backlog" in r.json()["error"]["message"]
    assert 'reason="max_num_queued_tokens"} 1.0' in http.get("/metrics").text
    http, _ = make_app(max_num_queued_tokens=1000)
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 2}).status_code == 200
    admission = http.app.state.admission
    assert (admission.queued_tokens, admission.sequences, admission.requests) == (0, 0, 0)


@pytest.mark.unit
def test_the_heap_is_trimmed_after_a_large_body_and_after_a_burst_at_most_once_per_interval():
    from gateway.memory import BURST_REQUESTS, LARGE_BODY_BYTES, HeapTrimmer

    calls: list[float] = []
    open_now = [0]
    trimmer = HeapTrimmer(lambda: open_now[0], trim=lambda pad: calls.append(time.monotonic()) or 1,
                          min_interval_s=0.2)

    async def main() -> None:
        trimmer.ended(1000)  # a small request, no burst: nothing to give back
        assert trimmer._pending is None
        open_now[0] = BURST_REQUESTS
        trimmer.started()
        open_now[0] = 1
        trimmer.ended(1000)  # the burst is not over yet
        assert trimmer._pending is None
        open_now[0] = 0
        trimmer.ended(1000)  # ... now it is
        await trimmer._pending
        assert len(calls) == 1 and trimmer.peak_requests == 0
        trimmer.ended(LARGE_BODY_BYTES)  # a large body, even with nothing else open
        trimmer.ended(LARGE_BODY_BYTES)  # merged into the pending trim
        await trimmer._pending
        assert len(calls) == 2 and calls[1] - calls[0] >= 0.2  # not more often than the interval

    asyncio.run(main())
    assert HeapTrimmer(lambda: 0).trim is not None  # glibc's malloc_trim is found on Linux


# --- tokenising large requests off the loop, in bounded batches ------------------------------------------


class CountingTokenizer:
    """The real SmolLM2 tokenizer, counting the characters each call was given."""

    def __init__(self, folder):
        from gateway.tokenizer import Tokenizer

        self.real = Tokenizer.from_dir(folder)
        self.eos_token_ids = self.real.eos_token_ids
        self.calls: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls.append(len(text))
        return self.real.encode(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        self.calls.append(sum(map(len, texts)))
        return self.real.encode_batch(texts, add_special_tokens)


def _serving(tokenizer, **cfg):
    from engine.config import EngineConfig
    from gateway.metrics import Metrics
    from gateway.serving import ModelInfo, ServingContext

    return ServingContext(EngineConfig.from_flags(**cfg), None, tokenizer, ModelInfo(["tiny"], "/m", 256, 49152),  # type: ignore[arg-type]
                          Metrics("tiny"))


@pytest.mark.unit
def test_text_prompts_beyond_the_token_budget_stop_tokenising_early(smollm2_dir):
    from gateway.errors import APIError
    from gateway.serving import TOKENIZE_CHUNK_CHARS

    tok = CountingTokenizer(smollm2_dir)
    ctx = _serving(tok, max_prompt_tokens_per_request=1000)
    texts = ["fox " * 250] * 4096  # 1,000 characters and 250 tokens each: 1M tokens, 4 MB
    with pytest.raises(APIError) as e:
        asyncio.run(ctx.encode_many(texts, False, budget=1000))
    assert e.value.status == 400 and e.value.param == "prompt"
    assert "more than 1000 tokens" in e.value.message and "--max-prompt-tokens-per-request" in e.value.message
    assert sum(tok.calls) <= TOKENIZE_CHUNK_CHARS and max(tok.calls) <= TOKENIZE_CHUNK_CHARS  # not the 4 MB
    tok.calls.clear()  # one text of 4 MB: counted piece by piece, stopped within a piece of the budget
    with pytest.raises(APIError):
        asyncio.run(ctx.encode_many(["fox " * 1_000_000], False, budget=1000, param="messages"))
    assert tok.calls == [TOKENIZE_CHUNK_CHARS - 1]  # one piece, cut before a space
    # truncated prompts count as truncated: 600 prompts kept to 10 tokens each fit a budget of 6000
    tok.calls.clear()
    ids = asyncio.run(ctx.encode_many(texts[:600], False, budget=6000, keep=10))
    assert len(ids) == 600 and max(tok.calls) <= TOKENIZE_CHUNK_CHARS and len(tok.calls) > 1


@pytest.mark.unit
def test_a_long_text_within_the_budget_is_tokenised_whole_and_exactly(smollm2_dir):
    from gateway.serving import TOKENIZE_CHUNK_CHARS

    tok = CountingTokenizer(smollm2_dir)
    ctx = _serving(tok)
    text = "The quick brown fox, said the  dog:\n  it jumps!  " * (6 * TOKENIZE_CHUNK_CHARS // 250)
    ids = asyncio.run(ctx.encode_many([text], True, budget=10**7))
    assert ids == [tok.real.encode(text, add_special_tokens=True)]  # the pieces only counted it
    short = ["Hello there", "fox " * 3000]
    assert asyncio.run(ctx.encode_many(short, False, budget=10**7)) == [tok.real.encode(t) for t in short]


# --- a real server ------------------------------------------------------------------------------------


def _tiny(work, smollm2_dir):
    return tiny_model_with_tokenizer("llama", work / "m", smollm2_dir, vocab_size=49152)


def _args(*extra: str) -> list[str]:
    return ["--served-model-name", MODEL, "--max-model-len", "256", "--additional-config", RL, *extra]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    work = tmp_path_factory.mktemp("limits")
    s = start_server(work, str(_tiny(work, smollm2_dir)), *_args("--max-num-queued-reqs", "2",
                                                                  "--max-request-body-bytes", "65536",
                                                                  "--shutdown-timeout", "60"))
    yield s
    s.stop()


class Stream(threading.Thread):
    """A streaming completion read on a thread: `started` once its first chunk arrived."""

    def __init__(self, url: str, **body: Any):
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": MODEL, "prompt": [1, 2, 3], "stream": True, **body}
        self.started = threading.Event()
        self.events: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.started.set()


def _complete(url: str, n: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "n": n},
                      timeout=60)


def test_beyond_max_num_queued_reqs_is_503_with_retry_after_and_slots_come_back(server):
    r = _complete(server.url, 3)  # 3 sequences > --max-num-queued-reqs 2
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": OVERLOADED_MESSAGE, "type": "Service Unavailable", "param": None,
                                 "code": 503}
    for _ in range(3):  # every finished request gives its slots back
        assert _complete(server.url, 2).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'vllm:admission_rejections_total{{model_name="{MODEL}",reason="max_num_queued_reqs"}} 1.0' in metrics


def test_a_chunked_body_above_the_limit_is_413(server):
    def body():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"a" * 4096
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=body(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", content=b"x" * 70000, timeout=60)  # by Content-Length
    assert r.status_code == 413
    assert _complete(server.url, 1).status_code == 200


def _probe_while(url: str, work) -> tuple[Any, float]:
    """Run `work()` while GET /health is asked every 50 ms on a thread; its result and the slowest probe."""
    stop = threading.Event()
    latencies: list[float] = []

    def probe() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                stop.wait(0.05)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(latencies) >= 3, 30, "the /health probe to run")
        result = work()
    finally:
        stop.set()
        t.join(130)
    return result, max(latencies)


def test_a_body_of_text_at_the_size_limit_neither_blocks_the_loop_nor_keeps_its_memory(tmp_path, smollm2_dir):
    """16 MB of text prompts (4M tokens) against a 100,000-token budget: tokenised off the loop in bounded
    batches, stopped at the budget (not the whole body: that took 18 s and 800 MB), /health answers within
    a second throughout, and the gateway's RSS comes back (the heap is trimmed after a large body)."""
    s = start_server(tmp_path, str(_tiny(tmp_path, smollm2_dir)), *_args("--max-request-body-bytes", str(16 << 20),
                                                                         "--max-prompt-tokens-per-request", "100000"))
    try:
        gateway = s.child_pids()["gateway"]
        assert _complete(s.url, 1).status_code == 200
        before = rss(gateway)
        body = json.dumps({"model": MODEL, "prompt": ["fox " * 1000] * 4000, "max_tokens": 1}).encode()
        assert 15 << 20 < len(body) < 16 << 20

        def send() -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=120)
            return r, time.monotonic() - t0

        (r, took), slowest = _probe_while(s.url, send)
        assert r.status_code == 400 and "more than 100000 tokens" in r.json()["error"]["message"], r.text
        assert took < 10, f"refusing took {took:.1f}s"
        assert slowest < 1.0, f"/health took {slowest:.2f}s during the request"
        wait_for(lambda: rss(gateway) < before + (48 << 20), 10,
                 f"the gateway's RSS to come back near {before >> 20} MB (now {rss(gateway) >> 20} MB)")
        assert _complete(s.url, 1).status_code == 200
    finally:
        s.stop()


def _wait_draining(url: str) -> None:
    wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 30, "the gateway to drain")


def _no_processes_left(s) -> None:
    wait_for(lambda: not s.child_pids(), 20, "every child process to exit")


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(server):
    """Runs last in the module: it stops the shared server."""
    url = server.url
    # long enough not to finish before the pause lands, even on a fast machine (253 of 256 positions)
    a = Stream(url, max_tokens=253, ignore_eos=True)
    a.start()
    assert a.started.wait(60) and a.error is None
    assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200  # freeze it
    assert a.is_alive(), "stream A finished before the pause: the drain below would have nothing to wait for"
    server.proc.send_signal(signal.SIGTERM)
    _wait_draining(url)
    r = _complete(url, 1)  # sent after SIGTERM
    assert r.status_code == 503 and r.json()["error"]["message"] == DRAINING_MESSAGE, r.text
    assert r.headers["retry-after"] == "1"
    assert httpx.get(url + "/ping", timeout=10).status_code == 503  # load balancers move on
    assert server.proc.poll() is None  # still draining: A is running
    assert httpx.post(url + "/resume", timeout=30).status_code == 200  # dev routes still answer
    a.join(60)
    assert a.error is None and a.events[-1] == "[DONE]"
    finals = [e for e in a.events if isinstance(e, dict) and e["choices"][0].get("finish_reason")]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in a.events if isinstance(e, dict))
    assert server.proc.wait(60) == 0
    _no_processes_left(server)


def test_after_the_shutdown_timeout_running_requests_end_with_an_error_and_done(tmp_path, smollm2_dir):
    s = start_server(tmp_path, str(_tiny(tmp_path, smollm2_dir)), *_args("--shutdown-timeout", "1"))
    try:
        a = Stream(s.url, max_tokens=253, ignore_eos=True)  # as long as fits: it must outlast the pause
        a.start()
        assert a.started.wait(60) and a.error is None
        assert httpx.post(s.url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        assert a.is_alive(), "the stream finished before the pause: shutdown would have nothing to wait for"
        s.proc.send_signal(signal.SIGTERM)
        a.join(60)
        assert a.error is None and a.events[-1] == "[DONE]", a.events[-3:]
        err = a.events[-2]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        assert s.proc.wait(60) == 0
        _no_processes_left(s)
    finally:
        s.stop()


def test_a_second_sigterm_stops_at_once(tmp_path, smollm2_dir):
    s = start_server(tmp_path, str(_tiny(tmp_path, smollm2_dir)), *_args("--shutdown-timeout", "600"))
    try:
        a = Stream(s.url, max_tokens=253, ignore_eos=True)  # as long as fits: it must outlast the pause
        a.start()
        assert a.started.wait(60) and a.error is None
        assert httpx.post(s.url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        assert a.is_alive(), "the stream finished before the pause: shutdown would have nothing to wait for"
        s.proc.send_signal(signal.SIGTERM)
        _wait_draining(s.url)
        s.proc.send_signal(signal.SIGTERM)
        try:
            assert s.proc.wait(20) == 0  # not the 600 s the running request was allowed
        except subprocess.TimeoutExpired:
            pytest.fail("a second SIGTERM did not stop the server at once")
        _no_processes_left(s)
        a.join(30)
        assert not a.is_alive()
    finally:
        s.stop()
