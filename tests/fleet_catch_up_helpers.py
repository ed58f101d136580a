"""What the peer catch-up tests share (tests/test_fleet_catch_up*.py, docs/fleet.md "Catch-up from a peer"):
a safetensors copy tagged as an engine's update, a fake peer engine over HTTP, this engine's folder (`fleet`),
and a real `rollbus serve` of the tiny model in RL mode with its greedy tokens and logprobs."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import torch
from safetensors.torch import save_file

from engine.fleet.copy_format import copy_digest, copy_name
from engine.fleet.rejoin import FleetRecord, write_fleet_record
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


def _greedy(url: str, model: str) -> tuple[list[str], list[float]]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "one two three", "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _engine(tmp_path: Path, folder: Path, name: str, *extra: str, transfer_timeout_s: float = 60):
    """A `rollbus serve` of the tiny model in tmp_path/name, RL mode, gloo weight transfer, with `extra` flags."""
    from tests.server_helpers import start_server

    (tmp_path / name).mkdir(exist_ok=True)
    cfg = json.dumps({"backend": "gloo", "timeout_s": transfer_timeout_s})
    return start_server(tmp_path / name, str(folder), "--additional-config", RL, "--weight-transfer-config", cfg,
                        "--max-model-len", "128", "--block-size", "4", *extra)
