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
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from bus.messages import ControlState
from engine.fleet import catch_up as cu
from engine.fleet.catch_up import CatchUpConfig, Own, catch_up
from engine.fleet.copy_format import TensorHashes, copy_name, read_header
from engine.fleet.rejoin import FleetRecord, copy_tag, read_fleet_record, starting_state
from engine.weights.protocol import tensor_checksum
from tests.fleet_catch_up_helpers import RL, TENSORS, FakePeer, _copy, _digest, _engine, _greedy, fleet  # noqa: F401


def _own(peer: FakePeer) -> Own:
    return Own("run-b", 3, "fleet-1", (peer.url,), 100.0)


def _ask(peer: FakePeer):
    return lambda peers: [{"weight_version": peer.version, "committed_at": peer.committed_at}]


@pytest.mark.unit
def test_a_restarted_engine_takes_the_fleets_version_from_a_peer_and_serves_it(fleet):  # noqa: F811
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
def test_bytes_that_fail_verification_leave_the_engine_lost_on_the_fleets_version(fleet, fault):  # noqa: F811
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
def test_the_trainers_update_wins(fleet):  # noqa: F811
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
def test_no_peer_with_the_version_and_catch_up_off_keep_the_503(fleet, monkeypatch):  # noqa: F811
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


def _logged(log: str, event: str, field: str) -> float:
    line = next(ln for ln in log.splitlines() if event in ln)
    return float(line.split(f"{field}=")[1].split()[0].strip(",}"))


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
