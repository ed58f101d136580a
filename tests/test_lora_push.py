"""LoRA adapters over the weight-transfer path, through `rollbus serve` (ipc backend): engine.trainer's send_lora
and SkyRL's in-memory calls (/collective_rpc skyrl_set_lora_receive_target, the ordinary update, then
/skyrl/v1/load_lora_adapter {"in_memory": true}, skyrl_discard_in_memory_lora) give an adapter version whose
logprobs equal HF + PEFT; a second push is the next version; a bad push (rank, names, shapes, a missing B) is a
400 naming the adapter and the cause, and the version that served keeps serving. Sleep: level 1 keeps every
adapter; level 2 drops them with the weights: adapters from folders are read again when next used, pushed ones
are named in /sleep's answer and refused until pushed again."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.trainer import WeightSyncClient, WeightSyncFailed
from tests.lora_helpers import check_peft, make_adapter
from tests.serve_process import start_server
from tests.tiny_models import make_tiny_checkpoint

pytest.importorskip("peft")
TOL = 1e-4
RL = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_push")
    base = make_tiny_checkpoint("qwen3", root / "base")
    ad = {"a": make_adapter(base, root / "a", rank=4, seed=1),
          "a2": make_adapter(base, root / "a2", rank=4, seed=3, targets=["q_proj", "v_proj", "gate_proj"]),
          "big": make_adapter(base, root / "big", rank=16, seed=4)}
    server = start_server(root, str(base), "--tokens-only", "--enable-lora", "--max-lora-rank", "8",
                          "--enable-sleep-mode", "--lora-modules", f"fromfile={ad['a']}",
                          "--block-size", "4", "--additional-config", RL,
                          "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 30}')
    client = WeightSyncClient(server.url, backend="ipc")
    yield server, client, base, ad
    client.close()
    server.stop()


def _adapter(folder) -> tuple[dict[str, torch.Tensor], dict]:
    conf = json.loads((folder / "adapter_config.json").read_text())
    return load_file(str(folder / "adapter_model.safetensors")), conf


def _check_peft(server, base, folder, model: str, version: int) -> list[float]:
    return check_peft(server.url, base, folder, model, version)


def test_send_lora_pushes_versions_equal_to_peft(setup):
    server, client, base, ad = setup
    tensors, conf = _adapter(ad["a"])
    client.send_lora("pushed", tensors.items(), conf)
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["pushed"]["root"] == "rollbus-memory://pushed"
    _check_peft(server, base, ad["a"], "pushed", 1)
    tensors2, conf2 = _adapter(ad["a2"])  # other targets: what a2 does not target is zero, not a's
    t0 = time.perf_counter()
    client.send_lora("pushed", tensors2.items(), conf2)
    print(f"in-place push of a rank-4 adapter: {1e3 * (time.perf_counter() - t0):.0f} ms")
    _check_peft(server, base, ad["a2"], "pushed", 2)


def test_bad_pushes_are_refused_and_the_old_version_keeps_serving(setup):
    server, client, base, ad = setup
    tensors, conf = _adapter(ad["a"])
    client.send_lora("kept", tensors.items(), conf)
    before = _check_peft(server, base, ad["a"], "kept", 1)
    big, big_conf = _adapter(ad["big"])
    with pytest.raises(WeightSyncFailed, match="lora kept failed: LoRA rank 16 is greater than max_lora_rank 8"):
        client.send_lora("kept", big.items(), big_conf)
    name = next(iter(tensors))
    wrong = {**tensors, name: torch.zeros(3, 3)}
    with pytest.raises(WeightSyncFailed, match=r"shape \[3, 3\] does not match"):
        client.send_lora("kept", wrong.items(), conf)
    with pytest.raises(WeightSyncFailed, match="LoRA adapter 'kept': 'model.embed_tokens.weight' is not a LoRA A/B"):
        client.send_lora("kept", [*tensors.items(), ("model.embed_tokens.weight", torch.zeros(2, 2))], conf)
    half = {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}
    with pytest.raises(WeightSyncFailed, match="lora_A and lora_B must come in pairs; missing one for.*layer 0 q_proj"):
        client.send_lora("kept", half.items(), conf)
    target = {"kind": "lora", "lora_name": "kept", "adapter_config": conf}
    for body, why in (({"receive_target": target, "updates": []}, "updates must be a non-empty list"),
                      ({"receive_target": target, "updates": [{}], "pause": "keep"}, "unknown field(s) ['pause']")):
        r = httpx.post(f"{server.url}/push_lora_adapter", json=body)  # send_lora's one call, refused by name
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert _check_peft(server, base, ad["a"], "kept", 1) == before  # nothing changed
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text  # and the next full-model request is served by the model


def test_skyrl_in_memory_calls(setup):
    server, client, base, ad = setup
    tensors, conf = _adapter(ad["a2"])
    target = {"kind": "lora", "lora_name": "sky", "adapter_config": conf, "aliases": {}}
    r = httpx.post(f"{server.url}/collective_rpc", timeout=60,
                   json={"method": "skyrl_set_lora_receive_target", "kwargs": {"receive_target": target}})
    assert r.status_code == 200 and r.json() == {"results": [None]}, r.text
    client.send_weights(tensors.items(), pause=None)
    r = httpx.post(f"{server.url}/skyrl/v1/load_lora_adapter", json={"lora_name": "sky", "in_memory": True})
    assert r.status_code == 200, r.text
    _check_peft(server, base, ad["a2"], "sky", 1)
    r = httpx.post(f"{server.url}/skyrl/v1/load_lora_adapter", json={"lora_name": "never", "in_memory": True})
    assert r.status_code == 400 and "no weight update pushed it" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/skyrl/v1/load_lora_adapter", json={"lora_name": "sky2", "lora_path": str(ad["a"])})
    assert r.status_code == 200, r.text
    _check_peft(server, base, ad["a"], "sky2", 1)
    rpc = {"method": "skyrl_discard_in_memory_lora", "kwargs": {"lora_name": "sky"}}
    assert httpx.post(f"{server.url}/collective_rpc", json=rpc).json() == {"results": [True]}
    assert httpx.post(f"{server.url}/collective_rpc", json=rpc).json() == {"results": [False]}
    r = httpx.post(f"{server.url}/collective_rpc",
                   json={"method": "skyrl_set_lora_receive_target", "kwargs": {"receive_target": {"kind": "full"}}})
    assert r.status_code == 400 and "Not a LoRA receive target" in r.json()["error"]["message"]
    # aliases: a tensor the trainer sends once under another name (tied): v_proj's A is q_proj's
    q, k = (f"base_model.model.model.layers.0.self_attn.{m}_proj.lora_A.weight" for m in "qv")
    tied = ad["a2"].parent / "tied"
    shutil.copytree(ad["a2"], tied, dirs_exist_ok=True)
    save_file({**tensors, k: tensors[q].clone()}, str(tied / "adapter_model.safetensors"))
    target = {**target, "lora_name": "tied", "aliases": {k: q}}
    r = httpx.post(f"{server.url}/collective_rpc", timeout=60,
                   json={"method": "skyrl_set_lora_receive_target", "kwargs": {"receive_target": target}})
    assert r.status_code == 200, r.text
    client.send_weights([(n, t) for n, t in tensors.items() if n != k], pause=None)
    _check_peft(server, base, tied, "tied", 1)
    rpc = {"method": "skyrl_discard_in_memory_lora", "kwargs": {"lora_name": "tied"}}
    assert httpx.post(f"{server.url}/collective_rpc", json=rpc).json() == {"results": [True]}



def test_sleep_level_1_keeps_adapters_level_2_drops_them(setup):
    server, client, base, ad = setup
    tensors, conf = _adapter(ad["a2"])
    client.send_lora("slept", tensors.items(), conf)
    before = {m: _check_peft(server, base, ad[k], m, 1) for m, k in (("fromfile", "a"), ("slept", "a2"))}
    r = httpx.post(f"{server.url}/sleep?level=1", timeout=60)
    assert r.status_code == 200 and "lora_dropped" not in r.json(), r.text
    assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 200
    assert {m: _check_peft(server, base, ad[k], m, 1) for m, k in (("fromfile", "a"), ("slept", "a2"))} == before
    r = httpx.post(f"{server.url}/sleep?level=2", timeout=60)
    assert r.status_code == 200 and r.json()["lora_dropped"] == ["kept", "pushed", "slept"], r.text
    assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 200
    r = httpx.post(f"{server.url}/collective_rpc", json={"method": "reload_weights"}, timeout=120)
    assert r.status_code == 200, r.text
    assert _check_peft(server, base, ad["a"], "fromfile", 1) == before["fromfile"]  # read again from its folder
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "slept", "prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "LoRA adapter 'slept' was dropped by a level-2 sleep"), r.text
    client.send_lora("slept", tensors.items(), conf)
    assert _check_peft(server, base, ad["a2"], "slept", 2) == before["slept"]
