"""A restarted worker without its copy (docs/fleet.md "A new engine joining the fleet", engine.fleet.rejoin
fetch_own_copy, engine.weights.recovery): it fetches its own copy of the version its engine serves from a peer in
the engine's fleet record, verified as a catch-up is (tests/test_fleet_catch_up.py), and serves it, instead of a
503 until the trainer's next update; bytes that fail verification: the version lost, naming the peer.

CI: the fetch and the worker's thread against a fake peer over HTTP. `slow`: a real worker SIGKILLed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bus.messages import ControlState
from engine.fleet.catch_up import CatchUpConfig
from engine.fleet.copy_format import copy_name
from engine.fleet.rejoin import FleetRecord, copy_tag, write_fleet_record
from tests.fleet_catch_up_helpers import TENSORS, _engine, _greedy, fleet  # noqa: F401


@pytest.mark.unit
def test_a_restarted_worker_without_its_copy_takes_it_from_a_fleet_peer(fleet):  # noqa: F811
    """A running engine (update 7 of run-b in service: fleet-2) whose worker restarted without its copy: that
    worker's copy of fleet-2 from the peer in its fleet record, tagged as update 7 of run-b; refused (naming the
    peer) when the peer serves another version, or sends bytes that fail verification."""
    from engine.fleet.rejoin import fetch_own_copy, known_peers

    own, peer = fleet
    (own / copy_name(0)).unlink()  # its copy is gone
    state = ControlState(run_id="run-b", weight_commits=7, weight_version="fleet-2")
    cfg = CatchUpConfig(workers=1, attempts=2)
    assert known_peers(str(own), cfg) == (peer.url,)
    assert fetch_own_copy(str(own), 0, state, cfg) is None
    assert copy_tag(str(own / copy_name(0))) | {} == {"run_id": "run-b", "weight_commits": "7",
                                                      "weight_version": "fleet-2", "caught_up_from": peer.url}
    got = load_file(str(own / copy_name(0)))
    assert all(torch.equal(got[n], t) for n, t in TENSORS.items())
    (own / copy_name(0)).unlink()
    peer.corrupt = True
    why = fetch_own_copy(str(own), 0, state, cfg)
    assert "failed verification" in why and peer.url in why and peer.sent == 3
    assert sorted(p.name for p in own.iterdir()) == ["fleet.json"]
    other = ControlState(run_id="run-b", weight_commits=8, weight_version="fleet-3")
    assert fetch_own_copy(str(own), 0, other, cfg) == f"no fleet peer serves 'fleet-3' (asked {[peer.url]})"
    write_fleet_record(str(own), FleetRecord("fleet-1", 100.0, ()))
    assert fetch_own_copy(str(own), 0, state, cfg).startswith("no fleet peers")
    assert known_peers(str(own), CatchUpConfig(workers=1, peers=(peer.url + "/",))) == (peer.url,)


@pytest.mark.unit
def test_the_worker_fetches_on_a_thread_and_loads_what_arrived(fleet):  # noqa: F811
    """engine.weights.recovery.WeightRecovery: a restarted worker without its copy (update 7 of run-b, fleet-2 in
    service) asks the fleet on a thread, says Hello only once poll() loaded the copy; with a peer that sends
    bad bytes, poll() reports the version lost (WeightsLost, naming the peer's failure)."""
    from types import SimpleNamespace

    from bus.codec import decode
    from engine.weights.recovery import WeightRecovery

    class Model(torch.nn.Module):  # the two tensors of TENSORS, loaded as a worker's model loads its copy
        def __init__(self) -> None:
            super().__init__()
            self.held = {n: torch.zeros_like(t) for n, t in TENSORS.items()}

        def required_weight_names(self) -> set[str]:
            return set(self.held)

        def load_weights(self, weights, *, local: bool = False) -> set[str]:
            for n, w in weights:
                self.held[n].copy_(w)
            return set(self.held)

    class Dealer:
        def __init__(self) -> None:
            self.sent = []

        def send_multipart(self, frames, copy=False) -> None:
            self.sent.append(decode([bytes(f) for f in frames]))

    own, peer = fleet
    (own / copy_name(0)).unlink()
    link = SimpleNamespace(state=ControlState(run_id="run-b", weight_commits=7, weight_version="fleet-2"),
                           dealer=Dealer())
    sleep = SimpleNamespace(asleep=set(), missing=0)

    def worker() -> tuple[WeightRecovery, Model]:
        model = Model()
        r = WeightRecovery(model, folder=str(own), index=0, name="worker-0", donor=None, link=link, sleep=sleep,
                           control_timeout_s=5, fleet=CatchUpConfig(workers=1, attempts=1))
        r.restore()
        assert r.restoring is not None and r.fetching is not None  # no Hello to the scheduler yet
        r.fetching[0].join(30)
        return r, model

    r, model = worker()
    assert r.poll() and r.restoring is None and r.weights_lost is None and r.weight_commits == 7
    assert all(torch.equal(model.held[n], t) for n, t in TENSORS.items()) and link.dealer.sent == []
    assert not r.poll()
    (own / copy_name(0)).unlink()
    peer.corrupt = True
    r, model = worker()
    assert r.poll() and r.weights_lost == "fleet-2"
    [lost] = link.dealer.sent
    assert "failed verification" in lost.body.why and peer.url in lost.body.why and lost.body.version == "fleet-2"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_restarted_without_its_copy_takes_it_from_a_peer_engine(tmp_path, smollm2_dir):
    """a and b take fleet-1; b's worker copy is deleted and its worker SIGKILLed: the launcher restarts it, it
    fetches its copy from a (b's fleet record) and serves fleet-1 bitwise, not a 503 until the next update."""
    import os
    import signal

    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient
    from tests.server_helpers import tiny_model_with_tokenizer
    from tests.test_fleet_faults import _status, _until
    from tests.test_fleet_weight_sync import checksums_match, perturb, version

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    a, b = (_engine(tmp_path, folder, n, "--weights-recovery-dir", str(tmp_path / n / "copies")) for n in "ab")
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    try:
        perturb(trainer, seed=7)
        with WeightSyncClient([a.url, b.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-1")
        (tmp_path / "b" / "copies" / copy_name(0)).unlink()
        os.kill(b.child_pids()["worker-0"], signal.SIGKILL)
        _until(lambda: "worker.weights_from_fleet" in b.log(), 90, "b's worker fetching its copy from a")
        back = _until(lambda: _status(b.url) == 200, 60, "engine b serving again")
        assert "worker.weight_version_lost" not in b.log()
        assert version(b.url) == "fleet-1" and checksums_match(b.url, trainer)
        assert _greedy(b.url, str(folder)) == _greedy(a.url, str(folder))
        print(f"b's worker back on fleet-1 from a's copy, serving {back:.1f} s after it fetched")
    finally:
        a.stop()
        b.stop()
