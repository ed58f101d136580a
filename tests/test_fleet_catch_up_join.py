"""A new engine joining the fleet (docs/fleet.md "A new engine joining the fleet", engine.fleet.catch_up): no
copies of its own, it asks its peers (--weights-catch-up-peers) and fetches the newest committed version before
serving, verified as a restarted engine's catch-up (tests/test_fleet_catch_up.py); when it cannot, 503 naming
that version, never its checkpoint under its name; silent or uncommitted peers: its checkpoint.

CI: the pure rules and the fetch against a fake peer over HTTP. `slow`: a real engine joins a real one."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from bus.control_state import initial_state
from engine.fleet.catch_up import CatchUpConfig, fleet_peers, joining, newest, tp_mismatch
from engine.fleet.copy_format import copy_name
from engine.fleet.rejoin import FleetRecord, copy_tag, read_fleet_record, starting_state
from tests.fleet_catch_up_helpers import TENSORS, FakePeer, _copy, _engine, _greedy


@pytest.mark.unit
def test_a_new_engine_asks_its_peers_and_takes_whatever_they_committed():
    """The pure rules of a new engine joining (no copies, on its checkpoint): any committed version is newer."""
    own = joining("run-new", ("http://a:1",))
    assert (own.version, own.commits, own.committed_at) == (None, 0, float("-inf"))
    answers = [{"weight_version": "default", "committed_at": None},  # a peer on its own checkpoint
               {"weight_version": "fleet-2", "committed_at": 200.0}, None,
               {"weight_version": "default", "committed_at": 150.0}]  # committed under the checkpoint's label
    assert newest(own.version, own.committed_at, answers) == ("fleet-2", 200.0)
    assert newest(own.version, own.committed_at, answers[:1] + [None]) is None  # nothing committed: the checkpoint
    assert newest(own.version, own.committed_at, answers[3:]) == ("default", 150.0)
    assert fleet_peers(("http://a:1/", "http://b:2"), ["http://a:1", "http://c:3"], None) == (
        "http://a:1", "http://b:2", "http://c:3")
    assert tp_mismatch("http://a:1", 1, 1) is None
    assert tp_mismatch("http://a:1", 2, 1) == ("http://a:1 runs tensor parallel size 2, this engine 1: its copies "
                                               "are another layout (one file per tp rank)")
    assert tp_mismatch("http://a:1", True, 1) and tp_mismatch("http://a:1", "1", 1)


@pytest.fixture
def joiner(tmp_path):
    """A new engine's empty folder (no copies, no record); peer a serves fleet-2 (update 7 of run-a)."""
    own = tmp_path / "new"
    peer = FakePeer("fleet-2", _copy(tmp_path / "a.safetensors", "run-a", 7, "fleet-2"))
    yield own, peer
    peer.close()


@pytest.mark.unit
def test_a_new_engine_joining_the_fleet_fetches_its_version_before_serving(joiner):
    own, peer = joiner
    s = starting_state("fresh", str(own), resume=False, peer_catch_up=CatchUpConfig(workers=1), peers=(peer.url,))
    assert (s.run_id, s.weight_commits, s.weight_version, s.version_labels) == ("fresh", 1, "fleet-2", {"0": "fleet-2"})
    got = load_file(str(own / copy_name(0)))
    assert all(torch.equal(got[n], t) for n, t in TENSORS.items())
    assert copy_tag(str(own / copy_name(0))) | {} == {"run_id": "fresh", "weight_commits": "1",
                                                      "weight_version": "fleet-2", "caught_up_from": peer.url}
    assert read_fleet_record(str(own)) == FleetRecord("fleet-2", 200.0, (peer.url,))  # its restarts know the fleet
    assert sorted(p.name for p in own.iterdir()) == ["fleet.json", copy_name(0)]


@pytest.mark.unit
@pytest.mark.parametrize("fault", ["corrupt", "other_tp", "catch_up_off"])
def test_a_new_engine_that_cannot_fetch_answers_503_naming_the_fleets_version(joiner, fault, capsys):
    """Never its checkpoint under the fleet's name: update 1 of its run, of which it has no copy (the workers'
    restore refuses: 503 naming fleet-2); a refused peer is named in the log, nothing is left in the folder."""
    own, peer = joiner
    cfg: CatchUpConfig | None = CatchUpConfig(workers=1, attempts=2)
    if fault == "corrupt":
        peer.corrupt = True
    elif fault == "other_tp":
        peer.tp = 2
    else:
        cfg = None
    s = starting_state("fresh", str(own), resume=True, peer_catch_up=cfg, peers=(peer.url,))
    assert (s.run_id, s.weight_commits, s.weight_version) == ("fresh", 1, "fleet-2")
    assert not own.exists() or [p.name for p in own.iterdir()] == []
    log = capsys.readouterr().out
    assert "coordinator.fleet_moved_on" in log
    if fault == "other_tp":
        assert peer.sent == 0 and "runs tensor parallel size 2, this engine 1" in log and peer.url in log
    elif fault == "corrupt":
        assert peer.sent == 2 and "failed verification" in log


@pytest.mark.unit
def test_a_new_engine_whose_peers_are_silent_or_uncommitted_starts_on_its_checkpoint(joiner):
    own, peer = joiner
    cfg = CatchUpConfig(workers=1)
    dead = "http://127.0.0.1:9"  # nothing listens
    assert starting_state("fresh", str(own), resume=True, peer_catch_up=cfg, peers=(dead,)) == initial_state("fresh")
    peer.committed_at = None  # a fleet still on its checkpoint
    assert starting_state("fresh", str(own), resume=True, peer_catch_up=cfg, peers=(peer.url,)) == \
        initial_state("fresh")
    assert starting_state("fresh", str(own), resume=True, peer_catch_up=cfg) == initial_state("fresh")  # no peers
    assert peer.sent == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_engine_joins_on_the_fleets_version(tmp_path, smollm2_dir):
    """a takes fleet-1; b, a new engine with no copies of its own, is started with --weights-catch-up-peers a:
    it serves fleet-1 bitwise as a, never its checkpoint. c joins with --no-weights-catch-up and no copies
    folder: it answers 503 naming fleet-1."""
    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient
    from tests.server_helpers import tiny_model_with_tokenizer
    from tests.test_fleet_faults import assert_lost
    from tests.test_fleet_weight_sync import checksums_match, perturb, version

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)

    def engine(name: str, *extra: str):
        return _engine(tmp_path, folder, name, *extra)

    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    a = engine("a", "--weights-recovery-dir", str(tmp_path / "a" / "copies"))
    b = c = None
    try:
        perturb(trainer, seed=5)
        with WeightSyncClient([a.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-1")
        b = engine("b", "--weights-recovery-dir", str(tmp_path / "b" / "copies"), "--weights-catch-up-peers", a.url)
        assert "catch_up.done" in b.log()
        assert version(b.url) == "fleet-1" and checksums_match(b.url, trainer)
        assert httpx.get(b.url + "/weight_commit_info", timeout=10).json() == \
            httpx.get(a.url + "/weight_commit_info", timeout=10).json()
        assert _greedy(b.url, str(folder)) == _greedy(a.url, str(folder))
        c = engine("c", "--weights-catch-up-peers", a.url, "--no-weights-catch-up")
        assert_lost(c.url, str(folder), "fleet-1")
    finally:
        for s in (a, b, c):
            if s is not None:
                s.stop()
