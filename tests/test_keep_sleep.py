"""A keep pause whose frozen requests survive a release of weight and KV memory (SkyRL 0.4's
skyrl_sleep_for_weight_sync / skyrl_wake_for_weight_sync through /collective_rpc), and /weight_checker reset
zeroing every weight, over a real `rollbus serve` (a tiny random qwen2 with SmolLM2's tokenizer, batch invariance
on; tests/interop/test_skyrl_sync.py runs the same with SmolLM2 under SkyRL's own clients).

The frozen requests must finish with exactly the tokens and logprobs of an uninterrupted run: with offload_kv
their KV blocks are copied to the host and put back; without it they recompute their KV from their tokens."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from engine.trainer import weight_checksums
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.test_ipc_pickled import json_send
from tests.waits import wait_for

pytestmark = pytest.mark.timeout(900)
RL_BI = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'
REQUESTS = [  # greedy and seeded, different prompt lengths
    {"prompt": "The three laws of motion are", "temperature": 0},
    {"prompt": "Once upon a time, in a small village by the sea, there lived", "temperature": 1.0, "seed": 7},
    {"prompt": "def fibonacci(n):", "temperature": 0.8, "top_p": 0.9, "seed": 11},
]
MAX_TOKENS = 64  # a tiny model steps in milliseconds when the machine is idle: the pause lands mid-way


def tiny_model(folder, smollm2_dir):
    """A tiny random qwen2 with SmolLM2's tokenizer (its whole vocabulary), 512 positions."""
    return tiny_model_with_tokenizer("qwen2", folder, smollm2_dir, vocab_size=49152, max_position_embeddings=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    return tiny_model(tmp_path_factory.mktemp("keepsleep") / "qwen2", smollm2_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    s = start_server(tmp_path_factory.mktemp("srv"), str(folder), "--additional-config", RL_BI,
                     "--enable-sleep-mode", "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 60}',
                     "--max-model-len", "512", "--block-size", "4")
    yield s
    s.stop()


class Stream(threading.Thread):
    """One streamed completion: its token ids and logprobs as they arrive."""

    def __init__(self, url: str, req: dict):
        super().__init__(daemon=True)
        self.url, self.req = url, req
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0, "stream": True,
                "return_tokens_as_token_ids": True, **self.req}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                self.error = f"{r.status_code}: {r.read().decode()}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = chunk["error"]["message"]
                    return
                lp = chunk["choices"][0].get("logprobs")
                if lp:
                    self.ids += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
                    self.lps += lp["token_logprobs"]


def run_all(url: str) -> list[Stream]:
    streams = [Stream(url, r) for r in REQUESTS]
    for s in streams:
        s.start()
    return streams


def results(streams: list[Stream]) -> list[tuple[list[int], list[float]]]:
    for s in streams:
        s.join(300)
        assert not s.is_alive() and s.error is None, s.error
    return [(s.ids, s.lps) for s in streams]


def rpc(url: str, method: str, **kwargs) -> httpx.Response:
    return httpx.post(url + "/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=120)


@pytest.fixture(scope="module")
def uninterrupted(server):
    out = results(run_all(server.url))
    assert all(len(ids) == MAX_TOKENS for ids, _ in out)
    return out


@pytest.mark.parametrize("offload_kv", [True, False])
def test_frozen_requests_survive_the_release_of_weights_and_kv(server, uninterrupted, offload_kv):
    url = server.url
    preempted = metric(server, "vllm:num_preemptions_total")
    streams = run_all(url)
    wait_for(lambda: all(len(s.ids) >= 3 for s in streams), 120, "every request has sampled a few tokens")
    assert httpx.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60).status_code == 200
    assert all(len(s.ids) < MAX_TOKENS for s in streams)  # caught mid-way
    r = rpc(url, "skyrl_sleep_for_weight_sync", offload_kv=offload_kv)
    assert r.status_code == 200 and r.json() == {"results": [None]}, r.text
    frozen = [len(s.ids) for s in streams]  # (the last step's tokens may reach the stream after the pause)
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    assert rpc(url, "skyrl_wake_for_weight_sync", tags=["weights"]).json() == {"results": [None]}
    # the sync: every parameter filled again (the checkpoint's values, so the continuation must not change)
    assert httpx.post(url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120).status_code == 200
    assert rpc(url, "skyrl_wake_for_weight_sync", tags=["kv_cache"]).status_code == 200
    assert [len(s.ids) for s in streams] == frozen  # nothing ran: the keep pause still holds
    assert httpx.post(url + "/resume", timeout=60).status_code == 200
    assert results(streams) == uninterrupted  # tokens and logprobs, bit for bit
    recomputed = metric(server, "vllm:num_preemptions_total") - preempted
    assert recomputed == (0 if offload_kv else len(REQUESTS)), recomputed


def test_bad_sync_calls_are_400_naming_the_field(server):
    url = server.url
    for kwargs, param in (({"offload_kv": "yes"}, "kwargs.offload_kv"), ({"offload": True}, "kwargs.offload")):
        r = rpc(url, "skyrl_sleep_for_weight_sync", **kwargs)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for tags in ("weights", ["gpu"]):
        r = rpc(url, "skyrl_wake_for_weight_sync", tags=tags)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.tags", r.text
    r = rpc(url, "skyrl_nap")
    assert r.status_code == 400 and "skyrl_sleep_for_weight_sync" in r.json()["error"]["message"]
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}  # nothing changed


def test_weight_checker_reset_zeroes_every_weight_until_a_full_update(server, uninterrupted, folder):
    from transformers import AutoModelForCausalLM

    url = server.url
    named = [(n, p.detach()) for n, p in
             AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters()]
    baseline = weight_checksums(named)
    check = lambda: httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": baseline},  # noqa: E731
                               timeout=120).json()
    assert check()["match"]
    assert httpx.post(url + "/weight_checker", json={"action": "reset"}, timeout=60).json() == {"status": "reset"}
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "reset"}
    sums = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=120).json()["checksums"]
    zero = weight_checksums([(n, torch.zeros_like(t)) for n, t in named])
    assert all(sums[f"dp0:pp0:pcp0:tp0:{n}"] == h for n, h in zero.items())  # every tensor zeroed

    def refused() -> str:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503, r.text
        return r.json()["error"]["message"]

    assert refused().startswith("weights were zeroed by /weight_checker reset")
    json_send(url, named[:-1], "partial")  # a sync that misses one tensor: the check says which
    assert check() == {"match": False, "mismatches": [named[-1][0]]}
    assert "(1 of " in refused()
    json_send(url, named, "full")
    assert check() == {"match": True, "mismatches": []}
    assert results(run_all(url)) == uninterrupted
