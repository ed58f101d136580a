"""Weight sync across a fleet: one WeightSyncClient([url1, url2]) call updates two real `rollbus serve` engines
over one Gloo group (vLLM's rank layout), all or nothing, and refuses a bad fleet before any transfer."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine.trainer import WeightSyncClient, WeightSyncFailed, weight_checksums
from engine.trainer.fleet import FleetError, check_versions, engine_urls, rank_offsets
from tests.server_helpers import free_port, start_server, tiny_model_with_tokenizer
from tests.tiny_models import perturb

RL = '{"rl_config": {"enabled": true}}'


def checksums_match(url: str, model) -> bool:
    r = httpx.post(url + "/weight_checker", timeout=60,
                   json={"action": "compare", "baseline": weight_checksums(model.named_parameters())})
    assert r.status_code == 200, r.text
    return r.json()["match"]


def version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]


def assert_unchanged(urls: list[str], trainer, before: dict[str, torch.Tensor]) -> None:
    """After a refused update: every engine still holds `before` (the trainer is put back to it), resumed."""
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            p.copy_(before[n])
    assert all(checksums_match(u, trainer) for u in urls), "a refused update changed an engine's weights"
    assert not any(httpx.get(u + "/is_paused", timeout=10).json()["is_paused"] for u in urls)



@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_dir):
    folder = tiny_model_with_tokenizer("qwen2", tmp_path_factory.mktemp("fleet") / "qwen2", smollm2_dir)
    cfg = json.dumps({"backend": "gloo", "timeout_s": 20})
    dirs = [tmp_path_factory.mktemp(f"engine{i}") for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # both start at once
        started = [pool.submit(start_server, d, str(folder), "--additional-config", RL, "--weight-transfer-config",
                               cfg, "--max-model-len", "128", "--block-size", "4", "--enable-sleep-mode")
                   for d in dirs]
    servers = [f.result() for f in started if f.exception() is None]
    try:
        for f in started:
            if f.exception() is not None:
                raise f.exception()
        from transformers import AutoModelForCausalLM

        yield servers, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        for s in servers:
            s.stop()


@pytest.mark.timeout(300)
def test_one_update_reaches_both_engines_and_a_refusal_commits_on_neither(fleet):
    (a, b), trainer = fleet
    urls = [a.url, b.url]
    with WeightSyncClient(urls, backend="gloo", timeout_s=30) as client:
        perturb(trainer, seed=1)
        client.send_weights(trainer.named_parameters(), version="fleet-1")
        assert [version(u) for u in urls] == ["fleet-1", "fleet-1"]
        assert all(checksums_match(u, trainer) for u in urls), "an engine differs from the trainer"

        # engine b refuses (its weights are asleep): neither engine commits, the trainer hears b's name fast
        assert httpx.post(b.url + "/sleep?level=1", timeout=60).status_code == 200
        before = {n: p.clone() for n, p in trainer.named_parameters()}
        perturb(trainer, seed=2)
        t = time.monotonic()
        with pytest.raises(WeightSyncFailed) as e:
            client.send_weights(trainer.named_parameters(), version="fleet-2")
        assert time.monotonic() - t < 5.0
        assert b.url in str(e.value) and a.url not in str(e.value) and e.value.status == 409
        assert httpx.post(b.url + "/wake_up", timeout=60).status_code == 200
        assert [version(u) for u in urls] == ["fleet-1", "fleet-1"]
        assert_unchanged(urls, trainer, before)

        perturb(trainer, seed=3)  # the fleet takes the next update as one again
        client.send_weights(trainer.named_parameters(), version="fleet-3")
        assert [version(u) for u in urls] == ["fleet-3", "fleet-3"]
        assert all(checksums_match(u, trainer) for u in urls)


@pytest.mark.timeout(300)
def test_an_engine_refusing_at_finish_leaves_every_engine_on_the_old_version(fleet):
    """Two-phase finish: engine b refuses the finish (its update was dropped under it, as a lost worker or
    another controller would) after the transfer; engine a had verified its part but commits nothing, and
    the trainer hears b's name within 5 s. Before, a committed alone and the fleet split."""
    (a, b), trainer = fleet
    urls = [a.url, b.url]
    with WeightSyncClient(urls, backend="gloo", timeout_s=30) as client:
        perturb(trainer, seed=4)
        client.send_weights(trainer.named_parameters(), version="two-phase-1")
        before = {n: p.clone() for n, p in trainer.named_parameters()}
        transfer = client.sender.transfer

        def transfer_then_drop_b(*args):
            transfer(*args)
            assert httpx.post(b.url + "/abort_weight_update", timeout=30).status_code == 200

        client.sender.transfer = transfer_then_drop_b
        perturb(trainer, seed=5)
        t = time.monotonic()
        with pytest.raises(WeightSyncFailed) as e:
            client.send_weights(trainer.named_parameters(), version="two-phase-2")
        assert time.monotonic() - t < 5.0 + client.timings.get("transfer", 0.0)
        assert f"engine {b.url}: POST /finish_weight_update -> 409" in str(e.value) and a.url not in str(e.value)
        assert [version(u) for u in urls] == ["two-phase-1", "two-phase-1"]
        assert_unchanged(urls, trainer, before)

        client.sender.transfer = transfer  # the next update goes through on both
        perturb(trainer, seed=6)
        client.send_weights(trainer.named_parameters(), version="two-phase-3")
        assert [version(u) for u in urls] == ["two-phase-3", "two-phase-3"]
        assert all(checksums_match(u, trainer) for u in urls)


@pytest.mark.timeout(60)
def test_commit_weight_update_commits_only_a_verified_update(fleet):
    """The two rollbus-only steps on one engine: commit without a verified update is a 409 and changes
    nothing; a bad commit field is a 400 naming it."""
    (a, _), _ = fleet
    was = version(a.url)
    r = httpx.post(a.url + "/commit_weight_update", json={"weight_version": "nothing-verified"}, timeout=30)
    assert r.status_code == 409 and "finish_weight_update" in r.json()["error"]["message"]
    assert version(a.url) == was
    r = httpx.post(a.url + "/finish_weight_update", json={"commit": "no"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "commit"
    r = httpx.post(a.url + "/commit_weight_update", json={"weight_version": 7}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_version"


@pytest.mark.slow
@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_a_bad_fleet_is_refused_before_any_transfer_naming_the_engine(fleet):
    (a, b), trainer = fleet
    dead = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(FleetError, match=f"engine {dead} does not answer"):
        WeightSyncClient([a.url, dead], backend="gloo").send_weights(trainer.named_parameters(), version="x")
    assert time.monotonic() - t < 5.0

    r = httpx.post(b.url + "/update_weight_version", json={"new_version": "elsewhere"}, timeout=30)
    assert r.status_code == 200
    try:
        with pytest.raises(FleetError, match=f"engine {b.url} is on weight version 'elsewhere'"):
            WeightSyncClient([a.url, b.url], backend="gloo").send_weights(trainer.named_parameters(), version="y")
    finally:
        httpx.post(b.url + "/update_weight_version", json={"new_version": version(a.url)}, timeout=30)
    assert version(a.url) != "y"


@pytest.mark.unit
def test_rank_layout_and_fleet_checks_are_vllms():
    assert rank_offsets(["a", "b", "c"], [1, 2, 1]) == ([1, 2, 4], 5)
    with pytest.raises(FleetError, match="engine b: /get_world_size answered 0"):
        rank_offsets(["a", "b"], [1, 0])
    with pytest.raises(FleetError, match="listed twice"):
        engine_urls(["http://x:1", "http://x:1/"])
    with pytest.raises(FleetError, match="engine c is on weight version 'v0'"):
        check_versions(["a", "b", "c"], ["v1", "v1", "v0"])
    with pytest.raises(FleetError, match="ipc"):
        WeightSyncClient(["http://x:1", "http://y:1"], backend="ipc")
    with pytest.raises(FleetError, match="bus="):
        WeightSyncClient(["http://x:1", "http://y:1"], backend="gloo", bus="tcp://x:1")
