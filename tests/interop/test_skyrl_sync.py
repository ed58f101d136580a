"""SkyRL 0.4's colocated weight sync, unmodified, against rollbus serve: its RemoteInferenceClient (SkyRL venv)
keep-pauses, resets the prefix cache, calls sleep_for_weight_sync / wake_for_weight_sync (its worker-extension
methods on vLLM, answered natively here through /collective_rpc) around a real weight update that SkyRL's
SkyrlWeightSyncClient drives with vLLM's trainer engine (vLLM venv, tests/vllm_trainer_cpu.py), and the frozen
requests must finish with the tokens and logprobs of an uninterrupted run: with offload_kv their KV is kept on
the host, without it they recompute it from their tokens.

The update sends the checkpoint's own values (the weights were discarded by the sleep: every tensor must come
back), so the continuation has nothing to differ for. The server runs batch invariance, which makes a
request's numbers independent of its batch-mates and of prefill versus decode (the recompute)."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch

from tests.interop.conftest import HERE, venv_python
from tests.server_helpers import metric, start_server
from tests.test_keep_sleep import tiny_model
from tests.test_vllm_interop import SKYRL_CONTROL_PLANE, VLLM_PY, VllmTrainer, _readline

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    return tiny_model(tmp_path_factory.mktemp("skyrlsync") / "qwen2", smollm2_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    s = start_server(tmp_path_factory.mktemp("srv"), str(folder), "--additional-config",
                     '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}', "--enable-sleep-mode",
                     "--weight-transfer-config", '{"backend": "nccl", "timeout_s": 120}', "--enable-scale-out",
                     "--max-model-len", "512", "--block-size", "4", "--max-logprobs", "-1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(server, tmp_path_factory):
    if not VLLM_PY.exists() or not SKYRL_CONTROL_PLANE.is_file():
        pytest.skip(f"needs the vLLM venv ({VLLM_PY}) and SkyRL ({SKYRL_CONTROL_PLANE}): "
                    "bash tests/interop/setup_venvs.sh")
    t = VllmTrainer(server.url, True, tmp_path_factory.mktemp("trainer"), skyrl_control_plane=str(SKYRL_CONTROL_PLANE))
    yield t
    t.close()


def _line(proc: subprocess.Popen, timeout: float) -> dict:
    """The client's next JSON line (SkyRL logs to stdout too)."""
    while not (line := _readline(proc, timeout)).startswith("{"):
        print("skyrl:", line.rstrip())
    return json.loads(line)


def outputs(result: dict) -> list[tuple]:
    assert "ok" in result, result
    return [(o["response_ids"], o["response_logprobs"], o["stop_reasons"]) for o in result["ok"]]


@pytest.mark.parametrize("offload_kv", [True, False])
def test_skyrl_sleep_for_weight_sync_keeps_the_frozen_requests(server, folder, trainer, offload_kv):
    from transformers import AutoModelForCausalLM

    url = server.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
             .named_parameters()]
    preempted = metric(server, "vllm:num_preemptions_total")
    proc = subprocess.Popen([str(venv_python("skyrl")), str(HERE / "skyrl_sync_client.py"), url, model,
                             str(offload_kv).lower()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(HERE))
    try:
        assert _line(proc, 600) == {"broadcast": True}
        r = trainer.round(named)  # SkyRL's weight-sync client: start, update (the broadcast), finish
        assert r["ok"], r
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = _line(proc, 600)
    finally:
        proc.kill()
    assert "ok" in out["pause"] and out["done_at_pause"] == [False, False], out
    # frozen requests hold KV blocks: vLLM's answer is success false (retry later), not a failure
    assert [v["body"] for v in out["reset_while_frozen"]["ok"].values()] == [{"success": False}]
    for call in ("sleep", "wake_weights", "wake_kv"):
        assert [v["body"] for v in out[call]["ok"].values()] == [{"results": [None]}], (call, out[call])
    if not offload_kv:  # the frozen requests dropped their KV at the sleep: nothing holds a block
        assert [v["body"] for v in out["reset_running"]["ok"].values()] == [{"success": True}], out["reset_running"]
    assert "ok" in out["resume"], out["resume"]
    assert all("ok" in f for f in out["frozen"]), out["frozen"]
    frozen = [outputs({"ok": [f["ok"]]})[0] for f in out["frozen"]]
    reference = outputs(out["reference"])
    assert frozen == reference  # tokens, logprobs and stop reasons of the uninterrupted run, bit for bit
    recomputed = metric(server, "vllm:num_preemptions_total") - preempted
    assert recomputed == (0 if offload_kv else 2), recomputed
