"""TRL 1.16's VLLMClient, unmodified, against rollbus serve (see trl_client.py for the one shim: TRL's
is-vLLM-installed check)."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from tests.interop.conftest import MODEL, run_client, venv_python

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def trl(interop_server):
    python = venv_python("trl")
    t0 = time.monotonic()
    out = run_client(python, "trl_client.py", interop_server.url)
    out["_wall_s"] = time.monotonic() - t0
    print(f"TRL client run: {out['_wall_s']:.1f} s")
    return out


def _tokenize(url: str, **body) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_generate_with_logprobs(trl, interop_server) -> None:
    assert trl["model"] == MODEL
    g = trl["generate"]["ok"]
    url = interop_server.url
    assert g["prompt_ids"] == [_tokenize(url, prompt="Hello, AI!"), _tokenize(url, prompt="Tell me a joke")]
    assert len(g["completion_ids"]) == 4 and all(len(c) == 8 for c in g["completion_ids"])
    assert g["completion_ids"][0] == g["completion_ids"][1]  # greedy: the n=2 samples agree
    # logprobs=2: the sampled token and the top 2, sorted by probability; ids parsed from token_id:<id>
    for lps, ids, comp in zip(g["logprobs"], g["logprob_token_ids"], g["completion_ids"]):
        assert [len(p) for p in lps] == [len(i) for i in ids] and all(2 <= len(p) <= 3 for p in lps)
        assert all(p == sorted(p, reverse=True) for p in lps)
        assert [i[0] for i in ids] == comp  # greedy: the sampled token is the most likely


def test_chat_and_chat_with_tools(trl, interop_server) -> None:
    c = trl["chat"]["ok"]
    url = interop_server.url
    assert c["prompt_ids"] == [_tokenize(url, messages=[{"role": "user", "content": "Hi"}])]
    assert len(c["completion_ids"][0]) <= 6 and len(c["logprobs"][0]) == len(c["completion_ids"][0])
    # TRL sends tool_choice "none": the tools go to the chat template (SmolLM2's ignores them), no parsing
    tools = trl["chat_tools"]["ok"]
    assert tools["prompt_ids"] == [_tokenize(url, messages=[{"role": "user", "content": "Weather in Paris?"}])]
    assert len(tools["completion_ids"][0]) <= 4


def test_sequence_logprobs_score_what_was_generated(trl) -> None:
    g, s = trl["generate"]["ok"], trl["sequence_logprobs"]["ok"]
    actual = [lp[0] for lp in s["actual_logprobs"][0]]
    assert s["actual_token_ids"][0] == [[t] for t in g["completion_ids"][0][:-1]] or \
        len(actual) == len(g["completion_ids"][0])
    # prompt logprobs of the generated tokens equal the logprobs they were sampled with (raw logprobs)
    sampled = [lp[0] for lp in g["logprobs"][0]][:len(actual)]
    assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(actual, sampled)), (actual, sampled)
    assert all(len(row) == 3 for row in s["logprobs"][0])


def test_structured_outputs_are_served(trl) -> None:
    """TRL's structured_outputs_regex reaches rollbus's structured outputs (docs/structured-outputs.md)."""
    res = trl["structured_regex"]
    assert "error" not in res and res.get("ok"), res


def test_reset_prefix_cache_server_info_world_size(trl) -> None:
    assert trl["reset_prefix_cache"] == {"ok": None, "s": trl["reset_prefix_cache"]["s"]}
    info = trl["server_info"]["ok"]
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    assert info["model_config"]["max_model_len"] == 1024 and info["model_config"]["dtype"] == "torch.float32"
    assert trl["world_size"]["ok"] == 1


def test_update_control_flow_reaches_the_nccl_step(trl) -> None:
    """On CPU TRL stops where NCCL starts: init_communicator has read /server_info (weight_transfer_config)
    and /get_world_size and refuses the CPU device. An update started without that init is refused at
    once with a 409 that says what is missing (TRL's client raises it), not left hanging."""
    assert trl["init_communicator"]["error"].startswith("NotImplementedError") and \
        "needs a CUDA device" in trl["init_communicator"]["error"]
    err = trl["weight_update"]["error"]
    assert "409" in err and "/init_weight_transfer_engine" in err and trl["weight_update"]["s"] < 5
