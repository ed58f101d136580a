"""The gateway's side of the bus: submit requests to the scheduler, stream their outputs back, send
control commands through the coordinator, and notice when the engine dies.

asyncio-native (zmq.asyncio sockets created inside the running loop). One reader task per socket
dispatches incoming messages to per-request queues, so a request handler only awaits its own queue.
The command stream is followed by bus.follower.Follower, as in every other member (sequence checks,
gaps resynced with a fresh Welcome, the control state reduced in one place); the gateway does not ack.

Liveness: the heartbeat is a thread with its own socket (bus.member.HeartbeatThread), so an event loop
blocked by a huge request cannot get the gateway declared lost. The engine is down while the control
state lists a lost scheduler or worker (ControlState.lost: until it rejoins), while a restarted worker
lacks the weight version in service, or while the coordinator is silent; each clears by itself. A lost
scheduler, or this gateway declared lost (a stall), fails the open requests; a lost worker does not: the
scheduler fails those that ran on it and keeps the queued ones for after its return.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
import zmq
import zmq.asyncio

from bus import control_state
from bus.codec import CodecError, decode, encode
from bus.endpoints import COMMAND_TOPIC, Endpoints, presence_topic
from bus.follower import Follower, Refused, SequenceGap
from bus.member import HeartbeatThread, coordinator_restarted, is_own_loss
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    Command,
    CommandBody,
    ControlReply,
    ControlRequest,
    ControlState,
    ErrorInfo,
    ErrorKind,
    Heartbeat,
    Hello,
    MemberJoined,
    MemberLost,
    Members,
    OutputBatch,
    RequestOutput,
    Welcome,
)
from bus.sampling_params import SamplingParams
from bus.sockets import make_socket
from bus.topology import Topology
from gateway.dp_router import Balancer

log = structlog.get_logger()


class EngineDead(RuntimeError):
    pass


class DuplicateRequest(ValueError):
    """generate() was given the id of a request that is still running."""


class EngineClient:
    def __init__(self, ep: Endpoints, *, name: str | None = None, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 3.0, topology: Topology | None = None):
        self.ep = ep
        self.name = name or f"gateway-{os.getpid()}"
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        # data parallelism: one requests socket per engine, the router's view of their load (gateway.dp_router)
        self.topology = topology or Topology(dp=max(1, len(ep.engines)), dp_local=max(1, len(ep.engines)))
        self.num_engines = self.topology.dp
        self.balancer = Balancer.of(self.num_engines)
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.replies: dict[str, asyncio.Future[ControlReply]] = {}
        self.engine_stats: list[dict[str, float]] = [{} for _ in range(self.num_engines)]
        self.refused: str | None = None  # the coordinator refused us (protocol mismatch): for good
        self.silent: str | None = None  # the coordinator has been silent too long (clears when heard)
        self.follower = Follower(self.name, {MemberLost: self._on_member_lost, MemberJoined: self._on_member_joined})
        # engine processes that have joined (several engines only: the router sends nothing to an engine that
        # has not come up yet, e.g. another host's): from the coordinator's member list, then MemberJoined/Lost
        self.joined: set[str] = set()
        self._coordinator_seen = time.monotonic()
        self._command_seq = 0  # the highest seq of a command read on the SUB (coordinator_restarted)
        self._tasks: list[asyncio.Task] = []
        self._beat: HeartbeatThread | None = None

    @property
    def stats(self) -> dict[str, float]:
        """The latest scheduler stats of engine 0 (every engine's: engine_stats)."""
        return self.engine_stats[0]

    @property
    def dead_reason(self) -> str | None:
        """Why requests cannot be served now (503), or None. With several engines, one engine down is not
        the gateway's problem (the router sends elsewhere): only all of them down is."""
        state = self.follower.state
        down = None
        if all(self.engine_down_reason(e) for e in range(self.num_engines)):
            down = control_state.engine_down_message(state)
        return self.refused or self.silent or down or control_state.weights_lost_message(state)

    def engine_down_reason(self, engine: int) -> str | None:
        """Why engine `engine` cannot compute now (a scheduler or worker of it lost), or None. A lost engine
        process of no known engine counts against every engine."""
        lost = {n: m for n, m in self.follower.state.lost.items() if self.topology.engine_of(n) in (engine, None)}
        if lost:
            return control_state.engine_down_message(ControlState(lost=lost))
        if self.num_engines > 1:
            missing = [n for n in self.topology.members(engine) if n not in self.joined]
            if missing:
                return f"{', '.join(missing)} of engine {engine} not joined yet (starting, or on another host): retry"
        return None

    def engines_alive(self) -> list[bool]:
        return [self.engine_down_reason(e) is None for e in range(self.num_engines)]

    def pick_engine(self, requested: int | None, reservations: list[tuple[str, int]]) -> int:
        """The engine for one HTTP request's engine requests (all its choices share it, so they share its
        prefix cache): the one X-data-parallel-rank names, else the least loaded live one (gateway.dp_router).
        Reserves their load at once (`reservations`: (request id, tokens)); generate() ends it. EngineDead
        when that engine, or every engine, is down."""
        if self.dead_reason:
            raise EngineDead(self.dead_reason)
        if requested is not None:
            why = self.engine_down_reason(requested)
            if why:
                raise EngineDead(f"data-parallel engine {requested}: {why}")
            engine = requested
        else:
            engine = self.balancer.pick(self.engines_alive())
            if engine is None:
                raise EngineDead(control_state.engine_down_message(self.follower.state) or "no engine is up")
        for rid, tokens in reservations:
            self.balancer.add(rid, engine, tokens)
        return engine

    def release(self, request_ids: list[str]) -> None:
        """End reservations whose engine requests never started (the HTTP request failed first)."""
        for rid in request_ids:
            if rid not in self.queues:
                self.balancer.done(rid)

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def control_state(self) -> ControlState:
        """Mirrored from the coordinator's broadcasts (the Welcome snapshot, then every command)."""
        return self.follower.state

    @property
    def paused(self) -> bool:
        return self.control_state.paused is not None

    @property
    def rejecting_new_requests(self) -> bool:
        return control_state.rejects_new_requests(self.control_state)

    async def start(self, timeout_s: float = 60.0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ep.secure(self.ctx)
        self.engine_sockets = [make_socket(self.ctx, zmq.DEALER, connect=self.ep.engine(e).requests, identity=self.name)
                               for e in range(self.num_engines)]
        self.requests = self.engine_sockets[0]
        self.sub = make_socket(self.ctx, zmq.SUB, connect=self.ep.commands)
        self.sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, presence_topic(self.name))
        self.control_sock = make_socket(self.ctx, zmq.DEALER, connect=self.ep.control, identity=self.name)
        self.welcomed = asyncio.get_running_loop().create_future()
        await self._hello()
        self._tasks = [asyncio.create_task(t) for t in
                       (*(self._read_outputs(e) for e in range(self.num_engines)), self._read_commands(),
                        self._read_control(), self._watch())]
        # a plain context of its own: the heartbeat thread must not touch the asyncio context's sockets
        self._beat_ctx = zmq.Context()
        self.ep.secure(self._beat_ctx)
        self._beat = HeartbeatThread(self._beat_ctx, self.ep.control, self.name, self.interval,
                                     lambda: self.follower.seq or 0)
        await asyncio.wait_for(self.welcomed, timeout_s)
        await self._refresh_joined()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._beat is not None:
            self._beat.stop()
            self._beat_ctx.destroy(linger=0)
        self.ctx.destroy(linger=0)

    # --- requests -----------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: list[int], engine: int | None = None) -> AsyncIterator[RequestOutput]:
        """Yield output deltas until one has finished=True. If the caller stops early (client went away,
        or a stop string matched), the request is aborted in the engine. `engine`: the engine pick_engine
        chose (and reserved the load on); None picks one here."""
        if self.dead_reason:
            raise EngineDead(self.dead_reason)
        if request_id in self.queues:
            raise DuplicateRequest(f"request id {request_id!r} is already running")
        if engine is None or self.balancer.engine_of(request_id) != engine:
            engine = self.pick_engine(engine, [(request_id, len(prompt_token_ids) + (params.max_tokens or 0))])
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            await self._send(self.engine_sockets[engine], AddRequest(request_id, list(prompt_token_ids), params,
                                                       list(eos_token_ids), time.time()))
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self.queues.pop(request_id, None)
            if not finished and not self.dead_reason:
                await self.abort([request_id])
            self.balancer.done(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """To the engine that owns each request (an id no engine is known to own: to every engine)."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self.balancer.engine_of(rid)
            for e in (range(self.num_engines) if owner is None else (owner,)):
                by_engine.setdefault(e, []).append(rid)
        for e, ids in sorted(by_engine.items()):
            await self._send(self.engine_sockets[e], AbortRequests(ids))

    async def control(self, command: CommandBody, timeout_s: float = 0.0) -> ControlReply:
        """Broadcast a typed command (bus.messages) through the coordinator; returns once every member
        acked (or failed)."""
        rid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.replies[rid] = fut
        try:
            await self._send(self.control_sock, ControlRequest(rid, command, timeout_s))
            return await asyncio.wait_for(fut, (timeout_s or 30.0) + 5.0)
        finally:
            self.replies.pop(rid, None)

    # --- readers ------------------------------------------------------------------------------------

    async def _send(self, sock: zmq.asyncio.Socket, msg: Any) -> None:
        await sock.send_multipart(encode(msg), copy=False)

    async def _hello(self) -> None:
        await self._send(self.control_sock, Hello("gateway", self.name, os.getpid(), PROTOCOL_VERSION, None,
                                                  PROTOCOL_FINGERPRINT))

    async def _read_outputs(self, engine: int) -> None:
        sock = self.engine_sockets[engine]
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = decode(frames)
            except CodecError as e:
                log.warning("gateway.bad_message", error=str(e))
                continue
            if isinstance(batch, OutputBatch):
                self.engine_stats[engine] = batch.stats
                for out in batch.outputs:
                    q = self.queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)

    async def _read_commands(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            self._coordinator_seen = time.monotonic()
            try:
                msg = decode(frames[1:])
            except CodecError as e:
                log.warning("gateway.bad_message", error=str(e))
                continue
            if self.silent is not None:
                log.info("gateway.coordinator_back", after=self.silent)
                self.silent = None
            if isinstance(msg, Heartbeat) and coordinator_restarted(msg, self._command_seq):
                # a new coordinator: its control state replaces ours (a snapshot), our requests are gone
                self._fail_all("the coordinator restarted: running requests failed: retry")
                self._command_seq = 0
                self.follower.resync()
                await self._hello()
            elif isinstance(msg, Command):
                self._command_seq = max(self._command_seq, msg.seq)
                if is_own_loss(msg, self.name):  # our loop stalled past the heartbeat timeout: rejoin
                    self._fail_all(f"this gateway was declared lost ({msg.body.why}); the engine dropped its "
                                   "requests: retry")
                    await self._hello()
                try:
                    self.follower.command(msg)  # the gateway does not ack: its acks would be ignored
                except SequenceGap as gap:
                    log.warning("bus.sequence_gap", member=self.name, expected=gap.expected, got=gap.got)
                    self.follower.resync()
                    await self._hello()

    async def _refresh_joined(self) -> None:
        """Several engines: which engine processes are members now (after each Welcome: a resync may have
        skipped MemberJoined / MemberLost commands)."""
        if self.num_engines > 1:
            reply = await self.control(Members(), timeout_s=10.0)
            self.joined = set(reply.results) - set(self.follower.state.lost)

    def _on_member_joined(self, cmd: MemberJoined) -> None:
        self.joined.add(cmd.name)

    def _on_member_lost(self, cmd: MemberLost) -> None:
        self.joined.discard(cmd.name)
        # Another gateway going away is not our problem; a lost worker's requests are failed by the
        # scheduler (the queued ones wait for its return); a lost scheduler took every request with it.
        if cmd.role == "scheduler":
            engine = self.topology.engine_of(cmd.name)
            ids = None if engine is None or self.num_engines == 1 else self.balancer.open_on(engine)
            self._fail_all(f"engine process {cmd.name} was lost ({cmd.why}); running requests failed: retry", ids)

    async def _read_control(self) -> None:
        while True:
            frames = await self.control_sock.recv_multipart()
            try:
                msg = decode(frames)
            except CodecError as e:
                log.warning("gateway.bad_message", error=str(e))
                continue
            if isinstance(msg, Welcome):
                try:
                    self.follower.welcome(msg)  # a stale Welcome never rolls back what was applied
                except Refused as e:
                    self.refused = f"coordinator refused the gateway: {e}"
                    self._fail_all(self.refused)
                if not self.welcomed.done():
                    self.welcomed.set_result(msg)
                elif msg.accepted and self.num_engines > 1:  # a resync: the member list may have changed
                    self._tasks.append(asyncio.create_task(self._refresh_joined()))
            elif isinstance(msg, ControlReply):
                fut = self.replies.get(msg.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _watch(self) -> None:
        """The coordinator's heartbeats: silence past the timeout fails the open requests and marks the
        engine down until it is heard again. Time the loop spent blocked does not count as silence."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            if now - last > 2 * self.interval:  # we were not listening: nothing proves the coordinator silent
                self._coordinator_seen = max(self._coordinator_seen, now - self.interval)
            last = now
            if self.silent is None and now - self._coordinator_seen > self.timeout:
                self.silent = "coordinator is silent: the engine is down"
                self._fail_all(self.silent)

    def _fail_all(self, reason: str, request_ids: list[str] | None = None) -> None:
        """The engine can no longer finish what is open: end every open request (or those of
        `request_ids`: one engine's) with an error."""
        queues = self.queues if request_ids is None else {r: self.queues[r] for r in request_ids if r in self.queues}
        log.error("gateway.requests_failed", reason=reason, count=len(queues))
        for rid, q in queues.items():
            error = ErrorInfo(ErrorKind.ENGINE_DEAD, reason, status=503)
            q.put_nowait(RequestOutput(rid, [], None, None, True, "error", None, error, 0, 0, 0))
