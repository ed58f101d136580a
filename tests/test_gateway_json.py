"""HTTP bodies through gateway/responses.py (orjson): the same JSON values the stdlib wrote, valid JSON
where the stdlib wrote `NaN` (or refused with a 500), exact big integers both ways, and no gateway module
left writing bodies with the stdlib (a route added later with fastapi's JSONResponse fails here)."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from gateway.app import build_app
from gateway.responses import JSONResponse, dumps, loads
from gateway.serving import ModelInfo
from gateway.sse import sse
from tests.test_gateway_protocol import EOS, MAX_LEN, VOCAB, CharTokenizer, FakeClient, sse_events

pytestmark = pytest.mark.unit

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"


def strict_loads(raw: bytes) -> Any:
    """json.loads that refuses NaN / Infinity (not JSON: clients written in other languages choke)."""
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")
    return json.loads(raw, parse_constant=refuse)


CORPUS: list[Any] = [
    {"id": "chatcmpl-1", "choices": [{"index": 0, "text": "héllo — 你好 🙂\n\"q\"\\", "logprobs": None}]},
    {"top_logprobs": [{"a": -0.5, "b": -1.25e-7}, None], "offsets": [0, 1, 2], "nested": [[[]], {}]},
    {"big": 2**63 - 1, "neg": -2**63, "u64": 2**64 - 1, "float": 1e300, "tiny": 5e-324, "t": True, "n": None},
    {"tuple": (1, 2, (3,)), "empty": "", "ctrl": "\x00\x1f\x7f"},
]


@pytest.mark.parametrize("value", CORPUS)
def test_dumps_writes_the_json_value_the_stdlib_wrote(value: Any) -> None:
    ours = dumps(value)
    theirs = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert strict_loads(ours) == strict_loads(theirs)
    assert JSONResponse(value).body == ours
    assert sse(value) == b"data: " + ours + b"\n\n"


def test_non_str_keys_become_strings_as_the_stdlib_makes_them() -> None:
    value = {"results": {0: "a", 1: {2: [3]}}, "x": {None: 1, 2.5: 2}}
    assert strict_loads(dumps(value)) == json.loads(json.dumps(value))


def test_ints_beyond_64_bits_fall_back_to_the_stdlib_exactly() -> None:
    assert strict_loads(dumps({"seed": 2**64 + 1})) == {"seed": 2**64 + 1}
    assert loads(b'{"seed": 18446744073709551617, "x": [1]}') == {"seed": 2**64 + 1, "x": [1]}
    assert loads('{"v": 123456789012345678901234567890}')["v"] == 123456789012345678901234567890


def test_nan_and_inf_become_null_and_numpy_serialises() -> None:
    value = {"mass": [float("nan"), float("inf"), -float("inf"), 0.5], "f32": np.float32(0.25),
             "i64": np.int64(7), "arr": np.arange(3, dtype=np.int32)}
    assert strict_loads(dumps(value)) == {"mass": [None, None, None, 0.5], "f32": 0.25, "i64": 7, "arr": [0, 1, 2]}
    assert math.isnan(json.loads(json.dumps(float("nan"))))  # what the stdlib wrote instead: not JSON


def test_loads_refuses_what_is_not_json() -> None:
    for raw in (b"{", b"NaN", b"[1,]", b"\xff"):
        with pytest.raises(ValueError):
            loads(raw)


class NaNMassClient(FakeClient):
    """The engine reports a non-finite kept mass (a degenerate filter): the body must stay valid JSON."""

    async def generate(self, request_id, prompt_token_ids, params, eos_token_ids, engine=None):  # type: ignore[no-untyped-def]
        async for out in super().generate(request_id, prompt_token_ids, params, eos_token_ids):
            if out.token_ids:
                out.sampling_mass = [float("nan")]
            yield out


@pytest.fixture(scope="module")
def http() -> TestClient:
    info = ModelInfo(names=["tiny"], root="/m", max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=[EOS])
    app = build_app(EngineConfig(), NaNMassClient("Hi"), CharTokenizer(), info, manage_client=False)
    return TestClient(app, raise_server_exceptions=False)


def test_a_nan_in_a_response_is_null_not_a_500(http: TestClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "return_sampling_mass": True})
    assert r.status_code == 200, r.text  # Starlette's JSONResponse (allow_nan=False) raised: a 500
    assert r.headers["content-type"] == "application/json"
    assert strict_loads(r.content)["choices"][0]["sampling_mass"] == [None, None]


def test_a_nan_in_a_stream_chunk_is_null_not_a_nan_token(http: TestClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "return_sampling_mass": True,
                                           "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)  # the stdlib framing wrote `NaN` here, which JSON parsers other than Python's refuse
    for block in r.content.split(b"\n\n")[:-2]:
        strict_loads(block[len(b"data: "):])
    masses = [m for e in events[:-1] for c in e["choices"] for m in c.get("sampling_mass", [])]
    assert masses == [None, None]


def test_error_envelope_goes_through_the_same_encoder(http: TestClient) -> None:
    r = http.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert strict_loads(r.content)["error"]["type"] == "BadRequestError"


def _stdlib_body_writers(path: Path) -> list[str]:
    """Calls and imports in one module that would write a body without gateway/responses.py (json.dumps
    counts in the HTTP modules only, those importing fastapi or starlette: a chat template's tojson is
    not a body)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    http = any(isinstance(n, (ast.Import, ast.ImportFrom)) and any(
        (getattr(n, "module", None) or a.name).split(".")[0] in ("fastapi", "starlette") for a in n.names)
        for n in ast.walk(tree))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("fastapi.responses", "starlette.responses"):
            found += [f"{node.module}.{a.name}" for a in node.names if "JSON" in a.name]
        elif http and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "json" and node.attr == "dumps":
            found.append("json.dumps")
        elif isinstance(node, ast.Attribute) and node.attr == "json" and isinstance(node.value, ast.Name) \
                and node.value.id == "request":
            found.append("request.json()")
    return [f"{path.name}: {f}" for f in found]


def test_no_gateway_module_writes_or_reads_bodies_with_the_stdlib() -> None:
    offenders = [f for p in sorted(GATEWAY.glob("*.py")) if p.name != "responses.py" for f in _stdlib_body_writers(p)]
    assert offenders == [], "use gateway.responses (JSONResponse, dumps, loads) instead"
