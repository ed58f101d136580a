"""Peer catch-up: an engine restarted behind its fleet (its copies hold version V, a peer in its fleet record
committed W since: engine.fleet.rejoin) fetches W from a peer instead of waiting for the trainer's next push.

The coordinator runs it before anything else of the engine starts (so nothing serves meanwhile, and no trainer
can reach this engine: its peers keep serving throughout). For every worker of this engine it streams the
peer's recovery copy of W (GET /weight_copy: gateway/weight_copy_route.py, read from the peer's disk) into a
temporary file beside its own copies, checking on the way

- the version: the peer's header and the copy's own tag both say W;
- the bytes: the digest of everything received (copy_format.TensorHashes: sha256 over the header and each
  tensor's sha256) equals the one the peer sent (the transfer);
- the model: every tensor's name, dtype and shape equal this engine's own copy of that worker;
- the weights: each tensor's sha256 equals the one the peer's workers report for the weights they serve
  (POST /weight_checker {"action": "compare"}: /weight_checker's own checksum, so a copy the peer's disk
  corrupted or left stale is refused too; it costs the peer one checksum pass of its workers between steps).

and retags each file as update `commits + 1` of this engine's run under W's label. Before any transfer the
peer's tensor-parallel size must be this engine's (GET /get_world_size?include_dp=false): a copy is one tp
rank's part of the weights. Only when every worker's
file arrived and passed does it rename them over its own copies (all or nothing) and record the fleet commit
(fleet.json); the workers then restore them as on any resume. Anything else leaves the copies as they were.

The trainer's update wins: a peer refuses to send while it has an update in progress (503) or serves another
version than the one asked (409); the peers are then asked again (every BUSY_WAIT_S, not counted as a
failure). After the copies arrived the peers are asked once more; when the fleet moved on meanwhile the files
are dropped and the newer version fetched. Bounded: at most `attempts` failed transfers (bad bytes, a peer
that breaks off; round-robin over the peers serving W) and `deadline_s` in all; then the engine starts as
before catch-up existed, on W as lost (503 naming the newest version it heard of).

A new engine joining a fleet (no copies of its own, on its checkpoint: `joining`, `--weights-catch-up-peers`
or a fleet record without copies) takes the same path with `Own.version` None and `committed_at` -inf:
whatever a peer committed is newer than its checkpoint. Without a copy of its own to compare the layout with,
the peer's tensor-parallel size is checked here and the tensors' shapes by the workers when they load the
copy (a copy that does not fit is refused there, naming the peer, and the version answered 503).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode
from urllib.request import Request, urlopen

import structlog

from bus.topology import Topology
from engine.fleet.copy_format import TensorHashes, copy_name, data_length, layout_of, read_header, retagged, tag_of
from engine.weights.lifecycle import DEFAULT_TRANSFER_TIMEOUT_S

log = structlog.get_logger()

VERSION_HEADER = "X-Rollbus-Weight-Version"  # what GET /weight_copy sends (gateway/weight_copy_route.py)
DIGEST_HEADER = "X-Rollbus-Weights-Sha256"  # copy_format.TensorHashes.digest of the copy
CHUNK_BYTES = 4 << 20
BUSY_WAIT_S = 0.5  # between asks while a peer's update is in progress
PARTIAL = ".catch-up-"  # the files being fetched (never a copy's name: resume_point ignores them)


class CatchUpError(Exception):
    """A transfer that failed (counted against the attempts)."""


class PeerBusy(CatchUpError):
    """A peer mid-update, or moved on to another version: ask the peers again shortly (not counted)."""


@dataclass(frozen=True, slots=True)
class CatchUpConfig:
    """The engine's side: how many workers, the fleet's API key (the engines share --api-key), the bounds."""

    workers: int
    tp: int = 1  # workers per engine: worker w is tp rank w % tp of engine w // tp (/weight_checker's keys)
    api_key: str | None = None
    attempts: int = 3
    deadline_s: float = 300.0
    read_timeout_s: float = 30.0
    peers: tuple[str, ...] = ()  # --weights-catch-up-peers: asked beside the fleet record's


def catch_up_config(cfg: Any) -> CatchUpConfig | None:
    """--weights-catch-up (an EngineConfig): fetch the fleet's version from a peer at a restart behind it, or
    a restarted worker's copy, within the weight transfer's timeout; None when off."""
    if not cfg.rl.weights_catch_up:
        return None
    wt = cfg.rl.weight_transfer_config
    topo = Topology.from_config(cfg)
    return CatchUpConfig(workers=topo.world_size, tp=topo.tp, api_key=cfg.gateway.api_key,
                         deadline_s=wt.timeout_s if wt else DEFAULT_TRANSFER_TIMEOUT_S,
                         peers=tuple(cfg.rl.weights_catch_up_peers))


@dataclass(frozen=True, slots=True)
class Own:
    """This engine's copies: its run, updates committed, version; and the fleet record's peers and time."""

    run_id: str
    commits: int
    version: str | None  # None: a new engine on its checkpoint (it holds no version a peer committed)
    peers: tuple[str, ...]
    committed_at: float  # -inf: never part of a fleet commit


def joining(run_id: str, peers: tuple[str, ...]) -> Own:
    """A new engine on its checkpoint (no copies of its own): any version a peer committed is the fleet's."""
    return Own(run_id, 0, None, peers, float("-inf"))


def fleet_peers(*lists: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The peers to ask, in order, each once (the fleet record's, then --weights-catch-up-peers), without a
    trailing slash: the same engine named twice is asked once."""
    out: dict[str, None] = {}
    for urls in lists:
        for u in urls or ():
            out.setdefault(u.rstrip("/"), None)
    return tuple(out)


def newest(version: str | None, since: float, answers: list[dict[str, Any] | None]) -> tuple[str, float] | None:
    """The version the fleet moved on to (and when a peer committed it): the newest a peer committed after
    `since` (this engine's last fleet commit), when it is not `version` (this engine's); None when it did not
    move on. `answers` are the peers' /weight_commit_info bodies (None: no answer)."""
    newer = [(a["committed_at"], a["weight_version"]) for a in answers
             if a and isinstance(a.get("weight_version"), str) and isinstance(a.get("committed_at"), int | float)
             and not isinstance(a["committed_at"], bool) and a["committed_at"] > since
             and a["weight_version"] != version]
    if not newer:
        return None
    at, version = max(newer)
    return version, at


def sources(version: str, peers: tuple[str, ...], answers: list[dict[str, Any] | None]) -> list[str]:
    """The peers that serve `version` (by their /weight_commit_info)."""
    return [p for p, a in zip(peers, answers) if a and a.get("weight_version") == version
            and a.get("committed_at") is not None]


def catch_up(folder: str, own: Own, answers: list[dict[str, Any] | None], cfg: CatchUpConfig,
             ask: Callable[[tuple[str, ...]], list[dict[str, Any] | None]]) -> tuple[bool, str, float | None]:
    """(caught up, the fleet's version, when a peer committed it). `answers` are the peers' /weight_commit_info
    that showed the fleet moved on; `ask` asks them again."""
    t0 = time.monotonic()
    deadline = t0 + cfg.deadline_s
    found = newest(own.version, own.committed_at, answers)
    if found is None:
        return False, own.version, None
    target, at = found
    os.makedirs(folder, mode=0o700, exist_ok=True)  # a new engine's folder may not exist yet
    failures = 0
    while failures < cfg.attempts and time.monotonic() < deadline:
        peers = sources(target, own.peers, answers)
        if not peers:
            log.error("catch_up.no_peer_has_it", version=target, peers=list(own.peers))
            return False, target, at
        src = peers[failures % len(peers)]
        try:
            fetch_all(src, folder, target, own, cfg, deadline)
        except PeerBusy as e:
            log.info("catch_up.peer_busy", peer=src, version=target, why=str(e))
            time.sleep(BUSY_WAIT_S)
        except CatchUpError as e:
            failures += 1
            log.warning("catch_up.transfer_failed", peer=src, version=target, attempt=failures,
                        attempts=cfg.attempts, why=str(e))
        else:  # arrived and verified: was it still the fleet's version? (the trainer's update wins)
            answers = ask(own.peers)
            now = newest(own.version, own.committed_at, answers)
            if now is None or now[0] == target:
                install(folder, range(cfg.workers))
                log.info("catch_up.done", peer=src, version=target, workers=cfg.workers,
                         seconds=round(time.monotonic() - t0, 2))
                return True, target, at
            log.info("catch_up.fleet_moved_on", fetched=target, fleet=now[0])
            discard(folder, range(cfg.workers))
            target, at = now
            continue
        answers = ask(own.peers)
        target, at = newest(own.version, own.committed_at, answers) or (target, at)
    log.error("catch_up.gave_up", version=target, failures=failures, seconds=round(time.monotonic() - t0, 2))
    return False, target, at


def fetch_worker(folder: str, worker: int, run_id: str, commits: int, version: str, peers: tuple[str, ...],
                 answers: list[dict[str, Any] | None], cfg: CatchUpConfig) -> str | None:
    """A single worker restarted without its copy, in a running engine (its own copy missing or torn): that
    worker's copy of the version in service (`version`, update `commits` of `run_id`) from a fleet peer serving
    it (by `answers`, the peers' /weight_commit_info), checked as at an engine's catch-up and installed as its
    copy. None when it is there, else why not (each refusal naming its peer). Bounded as catch_up is."""
    deadline = time.monotonic() + cfg.deadline_s
    found = sources(version, peers, answers)
    if not found:
        return f"no fleet peer serves {version!r} (asked {list(peers)})"
    own = Own(run_id, commits - 1, version, peers, float("-inf"))  # retagged as update commits - 1 + 1
    failures: list[str] = []
    while len(failures) < cfg.attempts and time.monotonic() < deadline:
        src = found[len(failures) % len(found)]
        try:
            fetch_all(src, folder, version, own, cfg, deadline, (worker,))
        except CatchUpError as e:  # a busy peer counts too: the engine's own version is what it must serve
            failures.append(str(e))
            log.warning("catch_up.transfer_failed", peer=src, version=version, worker=worker,
                        attempt=len(failures), attempts=cfg.attempts, why=str(e))
            continue
        install(folder, (worker,))
        log.info("catch_up.worker_done", peer=src, version=version, worker=worker)
        return None
    return "; ".join(failures) or "out of time"


def partial_path(folder: str, worker: int) -> str:
    return os.path.join(folder, PARTIAL + copy_name(worker))


def fetch_all(url: str, folder: str, version: str, own: Own, cfg: CatchUpConfig, deadline: float,
              workers: Sequence[int] | None = None) -> None:
    """Every worker's copy (or those of `workers`) of `version` from `url` into its partial file, verified
    and retagged; on any failure none is left."""
    workers = range(cfg.workers) if workers is None else workers
    check_tp(url, cfg)
    try:
        baseline: dict[str, str] = {}
        t0, waited = time.monotonic(), 0.0
        for w in workers:
            if time.monotonic() > deadline:
                raise CatchUpError("out of time")
            sums, wait_s = fetch_copy(url, w, version, folder, own, cfg, deadline)
            waited += wait_s
            prefix = f"dp{w // cfg.tp}:pp0:pcp0:tp{w % cfg.tp}:"
            baseline.update({prefix + name: v for name, v in sums.items()})
        t1 = time.monotonic()
        compare_live(url, baseline, cfg)
        size = sum(os.path.getsize(partial_path(folder, w)) for w in workers)
        log.info("catch_up.verified", peer=url, version=version, bytes=size, transfer_s=round(t1 - t0, 2),
                 peer_wait_s=round(waited, 2), compare_s=round(time.monotonic() - t1, 2))
    except BaseException:
        discard(folder, workers)
        raise


def fetch_copy(url: str, worker: int, version: str, folder: str, own: Own, cfg: CatchUpConfig,
               deadline: float = float("inf")) -> tuple[dict[str, str], float]:
    """Worker's copy into its partial file (by `deadline`, monotonic); returns each tensor's sha256, and how
    long the peer took to answer (its digest of the copy, the first time it is asked for it)."""
    query = urlencode({"worker": worker, "weight_version": version})
    t0 = time.monotonic()
    with _request(url, f"/weight_copy?{query}", cfg, f"worker {worker}'s copy", busy=(409, 503)) as r:
        waited = time.monotonic() - t0
        return receive(r, r.headers, worker, version, folder, own, url, deadline), waited


def check_tp(url: str, cfg: CatchUpConfig) -> None:
    """The peer's tensor-parallel size is this engine's: each copy is one tp rank's part of the weights."""
    with _request(url, "/get_world_size?include_dp=false", cfg, "its tensor-parallel size") as r:
        try:
            tp = json.loads(r.read())["world_size"]
        except (ValueError, KeyError, TypeError) as e:
            raise CatchUpError(f"{url} answered /get_world_size with something else than a world size: {e}") from None
    refusal = tp_mismatch(url, tp, cfg.tp)
    if refusal:
        raise CatchUpError(refusal)


def tp_mismatch(url: str, theirs: object, ours: int) -> str | None:
    """Why a peer of tensor-parallel size `theirs` cannot send its copies to an engine of size `ours`."""
    if theirs == ours and isinstance(theirs, int) and not isinstance(theirs, bool):
        return None
    return (f"{url} runs tensor parallel size {theirs!r}, this engine {ours}: its copies are another layout "
            "(one file per tp rank)")


def compare_live(url: str, baseline: dict[str, str], cfg: CatchUpConfig) -> None:
    """The peer's workers hash the weights they serve and compare (/weight_checker): what arrived is those."""
    body = json.dumps({"action": "compare", "baseline": baseline}).encode()
    with _request(url, "/weight_checker", cfg, "its weights' checksums", body) as r:
        answer = json.loads(r.read())
    if not isinstance(answer, dict) or answer.get("match") is not True:
        bad = answer.get("mismatches", []) if isinstance(answer, dict) else []
        raise CatchUpError(f"what arrived from {url} is not what its workers serve: {len(bad)} tensors differ "
                           f"from its /weight_checker checksums ({bad[:3]})")


@contextmanager
def _request(url: str, path: str, cfg: CatchUpConfig, what: str, body: bytes | None = None,
             busy: tuple[int, ...] = (503,)) -> Iterator[Any]:
    """An HTTP request to a peer; its failures as CatchUpError, PeerBusy for the `busy` statuses (503: the
    peer's update in progress; for a copy also 409: the peer moved to another version, ask again)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = Request(url.rstrip("/") + path, data=body, headers=headers)
    try:
        with urlopen(req, timeout=cfg.read_timeout_s) as r:
            yield r
    except HTTPError as e:
        why = f"{url} answered {e.code} for {what}: {_message(e)}"
        raise (PeerBusy if e.code in busy else CatchUpError)(why) from None
    except (URLError, OSError, ValueError) as e:
        raise CatchUpError(f"{url}, {what}: {e}") from None


def receive(r: BinaryIO, headers: Any, worker: int, version: str, folder: str, own: Own, url: str,
            deadline: float = float("inf")) -> dict[str, str]:
    """One copy from the response `r` into worker's partial file (see the module's checks); each tensor's
    sha256 (/weight_checker's: of its bytes)."""
    said, digest = headers.get(VERSION_HEADER), headers.get(DIGEST_HEADER)
    if said != version:
        raise CatchUpError(f"{url} sent worker {worker}'s copy of version {said!r}, not {version!r}")
    if not digest:
        raise CatchUpError(f"{url} sent worker {worker}'s copy without its {DIGEST_HEADER}")
    try:
        header, raw = read_header(r)
        layout, size = layout_of(header), data_length(header)
        tensors = TensorHashes(header, raw)
    except ValueError as e:
        raise CatchUpError(f"{url} sent worker {worker} something that is not a weight copy: {e}") from None
    tag = tag_of(header)
    if tag is None or tag["weight_version"] != version:
        raise CatchUpError(f"{url}'s copy for worker {worker} is tagged {tag and tag['weight_version']!r}, "
                           f"not {version!r}")
    mine = own_layout(folder, worker)
    if mine is not None and mine != layout:
        diff = sorted(set(mine.items()) ^ set(layout.items()))[:3]
        raise CatchUpError(f"{url}'s copy for worker {worker} is not this engine's model "
                           f"(tensors differ in name, dtype or shape: {diff})")
    with open(partial_path(folder, worker), "wb") as f:
        f.write(retagged(header, run_id=own.run_id, weight_commits=str(own.commits + 1), weight_version=version,
                         caught_up_from=url))
        left = size
        while left:
            chunk = r.read(min(CHUNK_BYTES, left))
            if not chunk:
                raise CatchUpError(f"{url} broke off worker {worker}'s copy with {left} bytes to go")
            if time.monotonic() > deadline:
                raise CatchUpError(f"out of time with {left} bytes of worker {worker}'s copy to go")
            tensors.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    if r.read(1):
        raise CatchUpError(f"{url} sent more bytes for worker {worker} than its copy's header names")
    if tensors.digest() != digest:
        raise CatchUpError(f"worker {worker}'s copy from {url} failed verification: digest {tensors.digest()} of "
                           f"what arrived != {digest} sent")
    return tensors.tensors()


def own_layout(folder: str, worker: int) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    try:
        with open(os.path.join(folder, copy_name(worker)), "rb") as f:
            return layout_of(read_header(f)[0])
    except (OSError, ValueError):
        return None  # no copy of our own for this worker: the digest and the tag still hold


def install(folder: str, workers: Iterable[int]) -> None:
    for w in workers:
        os.replace(partial_path(folder, w), os.path.join(folder, copy_name(w)))


def discard(folder: str, workers: Iterable[int]) -> None:
    for w in workers:
        try:
            os.remove(partial_path(folder, w))
        except FileNotFoundError:
            pass


def _message(e: HTTPError) -> str:
    try:
        body = json.loads(e.read(4096))
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return e.reason or ""
