"""GET /weight_copy?worker=N&weight_version=V: rollbus's own (vLLM has no peer transfer). This engine's
recovery copy of worker N's weights (--weights-recovery-dir, written by the worker at every commit), streamed
as it lies on disk, for a peer engine restarted behind the fleet (engine.fleet.catch_up). Sent from the copy,
never from the workers: this engine keeps serving while a peer reads, and the bytes are the version in service
because the copy's tag (run, updates committed, label) must equal this engine's control state.

The answer is the safetensors file with `X-Rollbus-Weight-Version` (its label) and `X-Rollbus-Weights-Sha256`
(engine.fleet.copy_format.TensorHashes: sha256 over the header and each tensor's sha256, so the receiver checks
every byte and /weight_checker's per-tensor checksums in one pass; computed once per copy and kept while the
file is unchanged). The file stays open while
it streams, so a commit that replaces it meanwhile (a new inode) does not mix versions.

Refusals, in the OpenAI error shape: 400 a bad worker index; 404 no copies here (no --weights-recovery-dir, or
the checkpoint in service: the peer loads that itself); 409 this engine serves another version than the one
asked, or has lost its own; 503 (retry shortly) an update in progress, or its copy not written yet.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import BinaryIO

from fastapi import FastAPI
from starlette.responses import StreamingResponse

from bus.topology import Topology
from engine.config import EngineConfig
from engine.fleet.catch_up import DIGEST_HEADER, VERSION_HEADER
from engine.fleet.copy_format import copy_digest, copy_name, read_header, tag_of
from gateway.engine_client import EngineClient
from gateway.errors import CONFLICT, INTERNAL, NOT_FOUND, UNAVAILABLE, APIError, bad_request

CHUNK_BYTES = 4 << 20


def add_weight_copy_route(app: FastAPI, cfg: EngineConfig, client: EngineClient) -> None:
    folder = cfg.rl.weights_recovery_dir
    workers = Topology.from_config(cfg).world_size
    # worker -> ((dev, inode, mtime_ns, size) of the copy, its sha256): each copy hashed once while unchanged
    digests: dict[int, tuple[tuple[int, int, int, int], str]] = {}

    def digest(worker: int, f: BinaryIO) -> str:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        known = digests.get(worker)
        if known is None or known[0] != key:
            try:
                known = digests[worker] = (key, copy_digest(f, CHUNK_BYTES))
            except ValueError as e:
                raise APIError(f"worker {worker}'s copy is unreadable: {e}", status=500, type=INTERNAL) from None
        f.seek(0)
        return known[1]

    @app.get("/weight_copy")
    async def weight_copy(worker: str = "", weight_version: str | None = None) -> StreamingResponse:
        if not (worker.isascii() and worker.isdigit()) or int(worker) >= workers:
            raise bad_request(f"worker must be a worker index from 0 to {workers - 1}, got {worker!r}", "worker")
        if not folder:
            raise APIError("this engine keeps no weight copies (start it with --weights-recovery-dir)",
                           status=404, type=NOT_FOUND)
        state = client.control_state
        if state.weights_lost is not None:
            raise APIError(f"this engine lost weight version {state.weights_lost!r} itself", status=409,
                           type=CONFLICT)
        if weight_version is not None and weight_version != state.weight_version:
            raise APIError(f"this engine serves weight version {state.weight_version!r}, not {weight_version!r}",
                           status=409, type=CONFLICT, param="weight_version")
        if state.weight_update_active:
            raise APIError("a weight update is in progress here: retry once it commits or aborts", status=503,
                           type=UNAVAILABLE)
        if state.weight_commits == 0:
            raise APIError("this engine serves its checkpoint: no copy to send", status=404, type=NOT_FOUND)
        f = await asyncio.to_thread(_open, os.path.join(folder, copy_name(int(worker))))
        try:
            tag = await asyncio.to_thread(_tag, f)
            want = {"run_id": state.run_id, "weight_commits": str(state.weight_commits),
                    "weight_version": state.weight_version}
            if tag is None or any(tag.get(k) != v for k, v in want.items()):
                raise APIError(f"worker {worker}'s copy is not (yet) of the version in service "
                               f"({state.weight_version!r}, update {state.weight_commits}): retry shortly",
                               status=503, type=UNAVAILABLE)
            sha = await asyncio.to_thread(digest, int(worker), f)
            size = os.fstat(f.fileno()).st_size
        except BaseException:
            f.close()
            raise
        headers = {VERSION_HEADER: state.weight_version, DIGEST_HEADER: sha, "Content-Length": str(size)}
        return StreamingResponse(_stream(f), media_type="application/octet-stream", headers=headers)


def _open(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise APIError(f"no weight copy at {path}", status=404, type=NOT_FOUND) from None


def _tag(f: BinaryIO) -> dict[str, str] | None:
    try:
        header, _ = read_header(f)
    except ValueError:
        return None
    finally:
        f.seek(0)
    return tag_of(header)


async def _stream(f: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk
    finally:
        f.close()
