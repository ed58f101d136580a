"""Peer catch-up (docs/fleet.md "Catch-up from a peer", engine.fleet.catch_up): an engine restarted after its
fleet moved on fetches the fleet's version from a peer's recovery copies (GET /weight_copy), verified (the
version, the transfer's sha256, the tensors' layout, /weight_checker's per-tensor checksums of what the
peer serves), all workers or none; else it answers 503 naming the version, as before.

CI: the route against a fake engine client, and the fetch against a fake peer over HTTP (good bytes, corrupted
bytes, a wrong version, a peer mid-update, a fleet that moves on during the fetch). `slow`: two real engines,
b killed, a updated alone, b restarted: it serves a's version bitwise; with a's copy corrupted on disk it
refuses it and answers 503 naming the version while a keeps serving."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from bus.control_state import initial_state
from bus.messages import ControlState
from engine.fleet import catch_up as cu
from engine.fleet.catch_up import CatchUpConfig, Own, catch_up, fleet_peers, joining, newest, tp_mismatch
from engine.fleet.copy_format import TensorHashes, copy_digest, copy_name, read_header
from engine.fleet.rejoin import FleetRecord, copy_tag, read_fleet_record, starting_state, write_fleet_record
from engine.weights.protocol import tensor_checksum

RL = '{"rl_config": {"enabled": true}}'
TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b.bias": torch.ones(5, dtype=torch.bfloat16)}


def _copy(path: Path, run_id: str, commits: int, version: str, tensors: dict | None = None) -> bytes:
    save_file(tensors or TENSORS, str(path), metadata={"run_id": run_id, "weight_commits": str(commits),
                                                       "weight_version": version})
    return path.read_bytes()


def _digest(raw: bytes) -> str:
    return copy_digest(io.BytesIO(raw))


class FakePeer:
    """A peer engine over HTTP: /weight_commit_info, /weight_copy, /weight_checker compare, as a gateway answers
    them; `copy` is what it sends, `live` the per-tensor checksums its workers report, `busy` 503s first."""

    def __init__(self, version: str, copy: bytes, committed_at: float = 200.0) -> None:
        self.version, self.copy, self.committed_at = version, copy, committed_at
        self.digest = _digest(copy)
        self.live = {f"dp0:pp0:pcp0:tp0:{n}": tensor_checksum(t) for n, t in TENSORS.items()}
        self.busy, self.corrupt, self.sent, self.tp = 0, False, 0, 1
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _json(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path == "/weight_commit_info":
                    return self._json(200, {"weight_version": peer.version, "committed_at": peer.committed_at})
                if url.path == "/get_world_size":
                    return self._json(200, {"world_size": peer.tp})
                q = parse_qs(url.query)
                if q.get("weight_version") != [peer.version]:
                    return self._json(409, {"error": {"message": f"serves {peer.version!r}"}})
                if peer.busy:
                    peer.busy -= 1
                    return self._json(503, {"error": {"message": "a weight update is in progress here"}})
                body = bytearray(peer.copy)
                if peer.corrupt:
                    body[-3] ^= 0x01  # one bit of the last tensor, after the digest was taken
                peer.sent += 1
                self.send_response(200)
                self.send_header("X-Rollbus-Weight-Version", peer.version)
                self.send_header("X-Rollbus-Weights-Sha256", peer.digest)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bad = sorted(k for k, v in body["baseline"].items() if peer.live.get(k) != v)
                self._json(200, {"match": not bad, "mismatches": bad})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet(tmp_path):
    """This engine's folder: its copy of fleet-1 (update 3 of run-b), its record (fleet-1 at t=100, peer a);
    peer a serves fleet-2 (committed at t=200) from its copy (update 7 of run-a)."""
    own = tmp_path / "b"
    own.mkdir()
    _copy(own / copy_name(0), "run-b", 3, "fleet-1", {n: t * 0 for n, t in TENSORS.items()})
    peer = FakePeer("fleet-2", _copy(tmp_path / "a.safetensors", "run-a", 7, "fleet-2"))
    write_fleet_record(str(own), FleetRecord("fleet-1", 100.0, (peer.url,)))
    yield own, peer
    peer.close()


def _own(peer: FakePeer) -> Own:
    return Own("run-b", 3, "fleet-1", (peer.url,), 100.0)


def _ask(peer: FakePeer):
    return lambda peers: [{"weight_version": peer.version, "committed_at": peer.committed_at}]


@pytest.mark.unit
def test_a_restarted_engine_takes_the_fleets_version_from_a_peer_and_serves_it(fleet):
    own, peer = fleet
    s = starting_state("fresh", str(own), resume=True, peer_catch_up=CatchUpConfig(workers=1))
    assert (s.run_id, s.weight_commits, s.weight_version, s.version_labels) == ("run-b", 4, "fleet-2", {"0": "fleet-2"})
    got = load_file(str(own / copy_name(0)))  # the peer's tensors, retagged as this engine's next update
    assert all(torch.equal(got[n], t) for n, t in TENSORS.items())
    assert copy_tag(str(own / copy_name(0))) | {} == {"run_id": "run-b", "weight_commits": "4",
                                                      "weight_version": "fleet-2", "caught_up_from": peer.url}
    assert read_fleet_record(str(own)) == FleetRecord("fleet-2", 200.0, (peer.url,))
    assert sorted(p.name for p in own.iterdir()) == ["fleet.json", copy_name(0)]  # no partial file left


@pytest.mark.unit
@pytest.mark.parametrize("fault", ["corrupt", "wrong_version", "not_served"])
def test_bytes_that_fail_verification_leave_the_engine_lost_on_the_fleets_version(fleet, fault):
    own, peer = fleet
    before = (own / copy_name(0)).read_bytes()
    if fault == "corrupt":
        peer.corrupt = True
    elif fault == "wrong_version":  # the copy's own tag says another version than the peer claims
        peer.copy = _copy(own.parent / "x.safetensors", "run-a", 7, "fleet-0")
        peer.digest = _digest(peer.copy)
    else:  # what arrives is not what the peer's workers serve (its copy on disk is stale or damaged)
        peer.live = {k: "0" * 64 for k in peer.live}
    s = starting_state("fresh", str(own), resume=True, peer_catch_up=CatchUpConfig(workers=1, attempts=2))
    assert (s.weight_commits, s.weight_version) == (4, "fleet-2")  # 503 naming fleet-2: the restore refuses
    assert (own / copy_name(0)).read_bytes() == before, "a refused transfer touched the engine's copy"
    assert sorted(p.name for p in own.iterdir()) == ["fleet.json", copy_name(0)]
    assert peer.sent == 2  # bounded: `attempts` transfers, then it gives up


@pytest.mark.unit
def test_the_trainers_update_wins(fleet):
    """A peer mid-update answers 503: asked again (not a failure). The fleet moving on while the bytes travel:
    they are dropped and the newer version fetched."""
    own, peer = fleet
    peer.busy = 1
    answers = [{"weight_version": "fleet-2", "committed_at": 200.0}]
    asks = []

    def ask(peers):  # asked after the 503, then after the fetch: by then the trainer committed fleet-3
        asks.append(1)
        if len(asks) == 2:
            peer.version, peer.committed_at = "fleet-3", 300.0
            peer.copy = _copy(own.parent / "a3.safetensors", "run-a", 8, "fleet-3")
            peer.digest = _digest(peer.copy)
        return [{"weight_version": peer.version, "committed_at": peer.committed_at}]

    ok, version, at = catch_up(str(own), _own(peer), answers, CatchUpConfig(workers=1), ask)
    assert (ok, version, at) == (True, "fleet-3", 300.0) and peer.sent == 2 and len(asks) == 3
    assert copy_tag(str(own / copy_name(0)))["weight_version"] == "fleet-3"


@pytest.mark.unit
def test_no_peer_with_the_version_and_catch_up_off_keep_the_503(fleet, monkeypatch):
    own, peer = fleet
    assert catch_up(str(own), _own(peer), [None], CatchUpConfig(workers=1), _ask(peer))[0] is False
    s = starting_state("fresh", str(own), resume=True)  # --no-weights-catch-up
    assert (s.weight_commits, s.weight_version) == (4, "fleet-2") and peer.sent == 0
    monkeypatch.setattr(cu, "BUSY_WAIT_S", 0.01)
    peer.busy = 10**6  # a peer that stays mid-update: bounded by the deadline
    t0 = time.monotonic()
    assert catch_up(str(own), _own(peer), _ask(peer)(()), CatchUpConfig(workers=1, deadline_s=0.5), _ask(peer))[0] \
        is False
    assert time.monotonic() - t0 < 5


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


@pytest.mark.unit
def test_a_restarted_worker_without_its_copy_takes_it_from_a_fleet_peer(fleet):
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
def test_the_worker_fetches_on_a_thread_and_loads_what_arrived(fleet):
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


@pytest.mark.unit
def test_the_digest_covers_every_byte_and_names_each_tensors_checksum(tmp_path):
    raw = _copy(tmp_path / "c.safetensors", "run-a", 1, "v1")
    header, head = read_header(io.BytesIO(raw))
    hashes = TensorHashes(header, head)
    for i in range(len(head), len(raw), 7):  # any chunking
        hashes.update(raw[i:i + 7])
    assert hashes.tensors() == {n: tensor_checksum(t) for n, t in TENSORS.items()}  # /weight_checker's
    assert hashes.digest() == _digest(raw) != _digest(raw[:-1] + bytes([raw[-1] ^ 1]))
    gap = {**header, "b.bias": {**header["b.bias"], "data_offsets": [o + 8 for o in header["b.bias"]["data_offsets"]]}}
    with pytest.raises(ValueError, match="does not start where the one before it ends"):
        TensorHashes(gap, head)


# ------------------------------------------------------------------------------------- the route


@pytest.mark.unit
def test_weight_copy_sends_the_copy_of_the_version_in_service_and_refuses_anything_else(tmp_path):
    from tests.test_gateway_protocol import FakeClient, make_app

    raw = _copy(tmp_path / copy_name(0), "run-a", 2, "v2")
    client = FakeClient()
    client.control_state = ControlState(run_id="run-a", weight_commits=2, weight_version="v2")
    http, _ = make_app(client, additional_config=RL, weights_recovery_dir=str(tmp_path))
    r = http.get("/weight_copy?worker=0&weight_version=v2")
    assert r.status_code == 200 and r.content == raw
    assert r.headers["x-rollbus-weight-version"] == "v2"
    assert r.headers["x-rollbus-weights-sha256"] == _digest(raw)
    assert http.get("/weight_copy?worker=0").status_code == 200

    def refused(query: str) -> tuple[int, str]:
        r = http.get("/weight_copy" + query)
        return r.status_code, r.json()["error"]["message"]

    assert refused("?worker=1")[0] == 400 and refused("?worker=x")[0] == 400
    assert refused("?worker=0&weight_version=v3") == (409, "this engine serves weight version 'v2', not 'v3'")
    client.control_state = ControlState(run_id="run-a", weight_commits=2, weight_version="v2",
                                        weight_update_active=True)
    assert refused("?worker=0")[0] == 503
    client.control_state = ControlState(run_id="run-a", weight_commits=3, weight_version="v3")
    assert refused("?worker=0")[0] == 503  # committed, its copy not written yet
    client.control_state = ControlState(run_id="run-a", weight_commits=2, weight_version="v2", weights_lost="v2")
    assert refused("?worker=0")[0] == 409
    client.control_state = ControlState(run_id="run-a")
    assert refused("?worker=0")[0] == 404  # the checkpoint
    http, _ = make_app(client, additional_config=RL)
    assert refused("?worker=0")[0] == 404  # no --weights-recovery-dir
    assert make_app(client)[0].get("/weight_copy?worker=0").status_code == 404  # not in RL / dev mode


# ------------------------------------------------------------------------------------- two real engines


def _greedy(url: str, model: str) -> tuple[list[str], list[float]]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "one two three", "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _logged(log: str, event: str, field: str) -> float:
    line = next(ln for ln in log.splitlines() if event in ln)
    return float(line.split(f"{field}=")[1].split()[0].strip(",}"))


def _engine(tmp_path: Path, folder: Path, name: str, *extra: str, transfer_timeout_s: float = 60):
    """A `rollbus serve` of the tiny model in tmp_path/name, RL mode, gloo weight transfer, with `extra` flags."""
    from tests.server_helpers import start_server

    (tmp_path / name).mkdir(exist_ok=True)
    cfg = json.dumps({"backend": "gloo", "timeout_s": transfer_timeout_s})
    return start_server(tmp_path / name, str(folder), "--additional-config", RL, "--weight-transfer-config", cfg,
                        "--max-model-len", "128", "--block-size", "4", *extra)


def two_engines_catch_up(tmp_path: Path, folder: Path, *, corrupt: bool = True, transfer_timeout_s: float = 60,
                         copies: Path | None = None) -> dict[str, float]:
    """a and b take fleet-1; b is killed; a alone takes fleet-2; b restarts and catches up from a. Then (corrupt)
    b is killed again, a takes fleet-3, a's copy is damaged on disk: b refuses it, 503 naming fleet-3."""
    from transformers import AutoModelForCausalLM

    from engine.trainer import WeightSyncClient
    from tests.test_fleet_faults import _completion, _kill_engine, assert_lost
    from tests.test_fleet_weight_sync import checksums_match, perturb, version

    copies = copies or tmp_path

    def engine(name: str):
        return _engine(tmp_path, folder, name, "--weights-recovery-dir", str(copies / name / "copies"),
                       "--weights-recovery-resume", transfer_timeout_s=transfer_timeout_s)

    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    a, b = engine("a"), engine("b")
    out: dict[str, float] = {}
    try:
        perturb(trainer, seed=1)
        with WeightSyncClient([a.url, b.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-1")
        _kill_engine(b)
        perturb(trainer, seed=2)
        with WeightSyncClient([a.url], backend="gloo") as client:  # the trainer dropped b from its list
            client.send_weights(trainer.named_parameters(), version="fleet-2")

        t0 = time.monotonic()
        b = engine("b")  # what its supervisor does: the same flags
        out["restart_s"] = time.monotonic() - t0
        log = b.log()
        out["catch_up_s"] = _logged(log, "catch_up.done", "seconds")
        out["transfer_s"] = _logged(log, "catch_up.verified", "transfer_s")
        out["compare_s"] = _logged(log, "catch_up.verified", "compare_s")
        out["peer_wait_s"] = _logged(log, "catch_up.verified", "peer_wait_s")
        assert version(b.url) == "fleet-2" and httpx.get(b.url + "/health", timeout=30).status_code == 200
        info_a = httpx.get(a.url + "/weight_commit_info", timeout=10).json()
        assert httpx.get(b.url + "/weight_commit_info", timeout=10).json() == info_a
        assert info_a["weight_version"] == "fleet-2"
        sums = [httpx.post(u + "/weight_checker", json={"action": "checksum"}, timeout=60).json()
                for u in (a.url, b.url)]
        assert sums[0] == sums[1] and checksums_match(b.url, trainer)
        assert _greedy(b.url, str(folder)) == _greedy(a.url, str(folder))  # tokens and logprobs, bitwise
        if not corrupt:
            return out

        _kill_engine(b)
        perturb(trainer, seed=3)
        with WeightSyncClient([a.url], backend="gloo") as client:
            client.send_weights(trainer.named_parameters(), version="fleet-3")
        copy = copies / "a" / "copies" / copy_name(0)
        raw = bytearray(copy.read_bytes())
        raw[-5] ^= 0x10  # a's copy damaged on disk: its digest agrees, its workers' checksums do not
        copy.write_bytes(bytes(raw))
        b = engine("b")
        assert version(b.url) == "fleet-3"
        assert "catch_up.gave_up" in b.log() and "failed" in b.log()
        assert_lost(b.url, str(folder), "fleet-3")
        assert _completion(a.url, str(folder)).status_code == 200  # the source kept serving
        return out
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_down_while_the_fleet_updated_catches_up_from_a_peer(tmp_path, smollm2_dir):
    from tests.server_helpers import tiny_model_with_tokenizer

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    out = two_engines_catch_up(tmp_path, folder)
    print(f"tiny qwen3: b restarted in {out['restart_s']:.1f} s, of which catch-up {out['catch_up_s']:.2f} s", out)


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


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_smollm2_catch_up_time(tmp_path, smollm2_dir):
    """The same with SmolLM2-135M itself (one copy of 540 MB, float32), the copies on a RAM disk as
    docs/fleet.md advises: prints the catch-up's seconds."""
    import shutil
    import tempfile

    shm = Path(tempfile.mkdtemp(prefix="rollbus-catch-up-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        out = two_engines_catch_up(tmp_path, smollm2_dir, corrupt=False, transfer_timeout_s=400, copies=shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(f"SmolLM2-135M: b restarted in {out['restart_s']:.1f} s, of which catch-up {out['catch_up_s']:.2f} s", out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_server_actor_catches_up_from_its_peer(tmp_path, smollm2_dir) -> None:
    """RollbusServerActor (the class SkyRL's ServerGroup places, here without Ray): servers 0 and 1 take
    fleet-1; server 1's actor is shut down; server 0 alone takes fleet-2; a new actor for server 1 with the
    same cli_args finds its copies (fleet-1) and its fleet record, catches up from server 0, and start()
    returns serving fleet-2, bitwise as server 0."""
    import asyncio
    from argparse import Namespace

    from transformers import AutoModelForCausalLM

    from engine.fleet.skyrl_actor import RollbusServerActor
    from engine.trainer import WeightSyncClient
    from tests.serve_process import free_port
    from tests.server_helpers import tiny_model_with_tokenizer
    from tests.test_fleet_weight_sync import checksums_match, perturb, version

    tiny_qwen3 = tiny_model_with_tokenizer("qwen3", tmp_path / "qwen3", smollm2_dir, vocab_size=49152)
    cli = Namespace(model=str(tiny_qwen3), max_model_len=256, kv_cache_memory_bytes=8 << 20,
                    weight_transfer_config={"backend": "gloo", "timeout_s": 60},
                    weights_recovery_dir=str(tmp_path / "copies"))
    trainer = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()

    def actor(idx: int) -> RollbusServerActor:
        return RollbusServerActor(Namespace(**vars(cli)), start_port=free_port(), server_idx=idx,
                                  log_dir=str(tmp_path / f"server-{idx}"))

    async def run() -> None:
        a, b = actor(0), actor(1)
        urls = [f"http://127.0.0.1:{(await s.start()).port}" for s in (a, b)]
        try:
            perturb(trainer, seed=21)
            with WeightSyncClient(urls, backend="gloo") as client:
                await asyncio.to_thread(client.send_weights, trainer.named_parameters(), "fleet-1")
            await b.shutdown()
            perturb(trainer, seed=22)
            with WeightSyncClient(urls[:1], backend="gloo") as client:
                await asyncio.to_thread(client.send_weights, trainer.named_parameters(), "fleet-2")
            b = actor(1)
            url_b = f"http://127.0.0.1:{(await b.start()).port}"
            assert version(url_b) == "fleet-2" and checksums_match(url_b, trainer)
            assert _greedy(url_b, str(tiny_qwen3)) == _greedy(urls[0], str(tiny_qwen3))
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(run())
