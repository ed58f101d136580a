"""SkyRL 0.4's RemoteInferenceClient, unmodified, against rollbus serve."""

from __future__ import annotations

import time

import pytest

from tests.interop.conftest import MODEL, run_client, venv_python

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def skyrl(interop_server):
    python = venv_python("skyrl")
    t0 = time.monotonic()
    out = run_client(python, "skyrl_client.py", interop_server.url, MODEL)
    out["_wall_s"] = time.monotonic() - t0
    print(f"SkyRL client run: {out['_wall_s']:.1f} s")
    return out


def test_tokenize_detokenize_render(skyrl) -> None:
    ids = skyrl["tokenize"]["ok"]
    assert len(ids) == 2 and all(ids)
    assert skyrl["detokenize"]["ok"] == ["Hello there, general", "Bye"]
    render = skyrl["render"]["ok"]
    assert render["token_ids"] and render["sampling_params"]["max_tokens"] == 5 and render["features"] is None


def test_generate_with_tokens(skyrl) -> None:
    g = skyrl["generate"]["ok"]
    assert len(g["response_ids"]) == 2 and g["response_ids"][0] == g["response_ids"][1]  # greedy
    assert g["stop_reasons"][0] in ("length", "stop") and len(g["response_logprobs"][0]) == len(g["response_ids"][0])
    assert g["responses"][0]  # SkyRL detokenized through POST /detokenize


def test_keep_pause_freezes_requests_and_queues_new_ones(skyrl) -> None:
    assert "ok" in skyrl["pause_keep"], skyrl["pause_keep"]
    assert skyrl["late_done_while_paused"] is False and skyrl["first_done_while_paused"] is False
    # a kept request holds KV: vLLM's reset answers success false (retry later), it does not fail
    reset = skyrl["reset_prefix_cache_while_kept"]["ok"]
    assert [v["body"] for v in reset.values()] == [{"success": False}]
    assert "ok" in skyrl["resume"]
    first, late = skyrl["first"]["ok"], skyrl["late"]["ok"]
    assert first["stop_reasons"] == ["length"] and len(first["response_ids"][0]) == 48
    assert late["response_ids"][0] == skyrl["generate"]["ok"]["response_ids"][0]  # queued, then served


def test_sleep_and_wake(skyrl) -> None:
    assert "ok" in skyrl["sleep"], skyrl["sleep"]
    assert skyrl["is_sleeping_after_sleep"]["ok"] is True
    assert "ok" in skyrl["wake_up"] and skyrl["is_sleeping_after_wake"]["ok"] is False
    assert skyrl["generate_after_wake"]["ok"]["response_ids"][0] == skyrl["generate"]["ok"]["response_ids"][0]
    assert [v["body"] for v in skyrl["reset_prefix_cache"]["ok"].values()] == [{"success": True}]
