"""Property-based fuzzing of every HTTP operation in the gateway's own /openapi.json (schemathesis), against a
real `rollbus serve` (tiny model, --api-key, the RL routes on): no answer is a 5xx, no process dies, and
/health is 200 at the end. The schema carries the request bodies and this server's limits
(gateway/openapi.py), so most generated requests are valid and really run; the report printed at the end
gives, per operation, how many generated cases got 2xx and 4xx (positive: cases the schema says are valid;
negative: cases built to break it).

Examples per operation: ROLLBUS_FUZZ_EXAMPLES (default 8; the slow-marked run, ROLLBUS_FUZZ_SLOW=1, takes
ROLLBUS_FUZZ_SLOW_EXAMPLES, default 100). Commands that change the engine's state (a pause, a weight-update
window) are undone after each case, so the next case meets a serving engine.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402  (after the importorskip)

from tests.serve_process import start_server  # noqa: E402
from tests.server_helpers import tiny_model_with_tokenizer  # noqa: E402

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW = os.environ.get("ROLLBUS_FUZZ_SLOW") == "1"
EXAMPLES = int(os.environ.get("ROLLBUS_FUZZ_SLOW_EXAMPLES" if SLOW else "ROLLBUS_FUZZ_EXAMPLES",
                              100 if SLOW else 8))
STATUS: dict[str, Counter] = defaultdict(Counter)  # "POST /v1/completions" -> {"positive 2xx": 3, ...}
SERVER_ERRORS: list[str] = []

pytestmark = [pytest.mark.timeout(1200)]
if SLOW:
    pytestmark.append(pytest.mark.slow)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("fuzz")
    folder = tiny_model_with_tokenizer("llama", tmp / "llama", smollm2_dir, vocab_size=49152)
    # a request without max_tokens gets 4 (a random model rarely says EOS: the rest of the context, 10-20 s
    # a request on this machine, would be most of the run)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # the RL routes are fuzzed too
        s = start_server(tmp, str(folder), "--served-model-name", "tiny", "--max-model-len", "128",
                         "--api-key", KEY, "--enable-scale-out", "--trust-request-chat-template",
                         "--num-gpu-blocks-override", "512", "--enable-sleep-mode",
                         "--weight-transfer-config", '{"backend": "ipc"}')
    s.pids = s.child_pids()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    raw = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=server.url, headers=AUTH, request_timeout=120)
    # the coverage phase (boundary values of every keyword, unexpected methods: hundreds of cases per
    # operation) runs in the slow lane
    schema.config.phases.coverage.enabled = SLOW
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def undo(case, response, server) -> None:
    """Put the engine back to serving after a case that changed its state."""
    if response.status_code >= 300:
        return
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as h:
        if case.path == "/pause":
            assert h.post("/resume").status_code == 200
        elif case.path == "/sleep":
            assert h.post("/wake_up").status_code == 200
            if (case.query or {}).get("level") == "2":  # the weights were discarded: the RL recipe reloads
                r = h.post("/collective_rpc", json={"method": "reload_weights"})
                assert r.status_code == 200, r.text
        elif case.path == "/weight_checker" and (case.body or {}).get("action") == "reset":
            assert h.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200  # zeroed
        elif case.path == "/collective_rpc" and (case.body or {}).get("method") == "skyrl_sleep_for_weight_sync":
            assert h.post("/wake_up").status_code == 200
            assert h.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
        elif case.path == "/start_weight_update":
            assert h.post("/finish_weight_update", json={}).status_code == 200
        elif case.path == "/finish_weight_update":  # {"commit": false} may leave a verified update open
            assert h.post("/abort_weight_update").status_code == 200


def _chose_deadline(case) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    info = body.get("init_info") if isinstance(body.get("init_info"), dict) else {}
    return "timeout" in (case.query or {}) or "timeout" in body or "timeout_s" in info


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not SLOW, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_operation_answers_a_server_error(case, server):
    response = case.call(headers=AUTH)
    mode = case.meta.generation.mode.name.lower() if case.meta is not None else "?"
    op = f"{case.method.upper()} {case.path}"
    STATUS[op][f"{mode} {response.status_code // 100}xx"] += 1
    undo(case, response, server)
    if response.status_code == 504 and _chose_deadline(case):
        return  # the case asked for a deadline (10 ms and up) that the command did not meet: 504 is right
    if response.status_code >= 500:
        SERVER_ERRORS.append(f"{op} -> {response.status_code}: {response.text[:300]} <- {case.as_curl_command()}")
    assert response.status_code < 500, f"{op}: {response.status_code} {response.text[:500]}\n{case.as_curl_command()}"


@pytest.mark.parametrize("weights_path", [[None, None], 7, "/no/such/model/folder"])
def test_a_bad_reload_weights_path_is_a_400_naming_it(server, weights_path):
    """Found by the fuzzer: a weights_path that is not a string, or not a model folder, was a 500 (the worker's
    TypeError / ValueError); now the gateway or the worker says 400 and names kwargs.weights_path."""
    r = httpx.post(server.url + "/collective_rpc", headers=AUTH, timeout=60,
                   json={"method": "reload_weights", "kwargs": {"weights_path": weights_path}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kwargs.weights_path", r.text


def test_tokenize_takes_a_chat_template_when_the_server_trusts_them(server):
    """Found by the fuzzer: /tokenize refused a request's chat_template even with --trust-request-chat-template."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": "<{{ messages[0].content }}>"}
    r = httpx.post(server.url + "/tokenize", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    chat = httpx.post(server.url + "/v1/chat/completions/render", headers=AUTH, json=body, timeout=60)
    assert chat.status_code == 200 and chat.json()["token_ids"] == r.json()["tokens"], chat.text


@pytest.mark.parametrize("path,body", [("/init_weight_transfer_engine", {"init_info": {"x": 2**70}}),
                                       ("/update_weights", {"update_info": {"names": [-(2**64)]}})])
def test_an_integer_the_bus_cannot_carry_is_a_400(server, path, body):
    """Found by the fuzzer's coverage phase: an integer beyond 64 bits in a free-form object of the body made
    the command unencodable for msgpack, a 500; now a 400 that says so."""
    r = httpx.post(server.url + path, headers=AUTH, json=body, timeout=60)
    assert r.status_code == 400 and "64 bits" in r.json()["error"]["message"], r.text


def test_after_the_fuzzing_everything_is_alive_and_bodies_were_exercised(server, api_schema):
    report = {op: dict(sorted(c.items())) for op, c in sorted(STATUS.items())}
    print("\nschemathesis coverage per operation:\n" + json.dumps(report, indent=1))
    out = os.environ.get("ROLLBUS_FUZZ_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    assert not SERVER_ERRORS, SERVER_ERRORS
    ops = {f"{o.method.upper()} {o.path}" for o in (r.ok() for r in api_schema.get_all_operations())}
    assert ops <= set(STATUS), f"operations never fuzzed: {sorted(ops - set(STATUS))}"
    # The generation routes' bodies were really served, not refused wholesale: each served some of its valid
    # cases, and together most of them
    served = ("POST /v1/completions", "POST /v1/chat/completions", "POST /inference/v1/generate",
              "POST /tokenize", "POST /detokenize")
    for op in served:
        assert STATUS[op]["positive 2xx"] > 0, (op, STATUS[op])
    ok, refused = (sum(STATUS[op][f"positive {k}"] for op in served) for k in ("2xx", "4xx"))
    assert ok >= 2 * refused, {op: STATUS[op] for op in served}
    assert server.proc.poll() is None and server.child_pids() == server.pids  # nobody died or restarted
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=server.url, timeout=30) as h:
        while h.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "/health never came back to 200"
            time.sleep(0.2)
        assert h.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}).status_code == 401
        r = h.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200, r.text
    log = server.log()  # (handled command failures are logged with their traceback: not a crash)
    assert "Exception in ASGI application" not in log and "member_lost" not in log, log[-3000:]
