"""The gateway's side of the bus: submit requests to the scheduler, stream their outputs back, send
control commands through the coordinator, and notice when the engine dies.

asyncio-native (zmq.asyncio sockets created inside the running loop). One reader task per socket
dispatches incoming messages to per-request queues, so a request handler only awaits its own queue.
The command stream is followed by bus.follower.Follower, as in every other member (sequence checks,
gaps resynced with a fresh Welcome, the control state reduced in one place); the gateway does not ack.
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

from bus.codec import CodecError, decode, encode
from bus.endpoints import COMMAND_TOPIC, Endpoints, presence_topic
from bus.follower import Follower, Refused, SequenceGap
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
    Heartbeat,
    Hello,
    MemberLost,
    OutputBatch,
    RequestOutput,
    Welcome,
)
from bus.sockets import make_socket
from engine import control_state
from engine.sampling_params import SamplingParams

log = structlog.get_logger()


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, ep: Endpoints, *, name: str | None = None, heartbeat_interval_s: float = 0.5,
                 heartbeat_timeout_s: float = 3.0):
        self.ep = ep
        self.name = name or f"gateway-{os.getpid()}"
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.replies: dict[str, asyncio.Future[ControlReply]] = {}
        self.stats: dict[str, float] = {}
        self.dead_reason: str | None = None
        self.follower = Follower(self.name, {MemberLost: self._on_member_lost})
        self._coordinator_seen = time.monotonic()
        self._tasks: list[asyncio.Task] = []

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
        self.requests = make_socket(self.ctx, zmq.DEALER, connect=self.ep.requests, identity=self.name)
        self.sub = make_socket(self.ctx, zmq.SUB, connect=self.ep.commands)
        self.sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
        self.sub.setsockopt(zmq.SUBSCRIBE, presence_topic(self.name))
        self.control_sock = make_socket(self.ctx, zmq.DEALER, connect=self.ep.control, identity=self.name)
        self.welcomed = asyncio.get_running_loop().create_future()
        await self._hello()
        self._tasks = [asyncio.create_task(t) for t in
                       (self._read_outputs(), self._read_commands(), self._read_control(), self._heartbeat())]
        await asyncio.wait_for(self.welcomed, timeout_s)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.ctx.destroy(linger=0)

    # --- requests -----------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: list[int]) -> AsyncIterator[RequestOutput]:
        """Yield output deltas until one has finished=True. If the caller stops early (client went away,
        or a stop string matched), the request is aborted in the engine."""
        if self.dead_reason:
            raise EngineDead(self.dead_reason)
        if request_id in self.queues:
            raise ValueError(f"request id {request_id!r} is already running")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            await self._send(self.requests, AddRequest(request_id, list(prompt_token_ids), params,
                                                       list(eos_token_ids), time.time()))
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self.queues.pop(request_id, None)
            if not finished and not self.dead_reason:
                await self.abort([request_id])

    async def abort(self, request_ids: list[str]) -> None:
        await self._send(self.requests, AbortRequests(list(request_ids)))

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
        await self._send(self.control_sock, Hello("gateway", self.name, os.getpid(), PROTOCOL_VERSION, {},
                                                  PROTOCOL_FINGERPRINT))

    async def _read_outputs(self) -> None:
        while True:
            frames = await self.requests.recv_multipart()
            try:
                batch = decode(frames)
            except CodecError as e:
                log.warning("gateway.bad_message", error=str(e))
                continue
            if isinstance(batch, OutputBatch):
                self.stats = batch.stats
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
            if isinstance(msg, Command):
                try:
                    self.follower.command(msg)  # the gateway does not ack: its acks would be ignored
                except SequenceGap as gap:
                    log.warning("bus.sequence_gap", member=self.name, expected=gap.expected, got=gap.got)
                    self.follower.resync()
                    await self._hello()

    def _on_member_lost(self, cmd: MemberLost) -> None:
        # Only the engine's own processes matter here: another gateway going away is not our problem.
        if cmd.role in ("scheduler", "worker"):
            self._fail_all(f"engine process {cmd.name} died ({cmd.why})")

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
                    self._fail_all(f"coordinator refused the gateway: {e}")
                if not self.welcomed.done():
                    self.welcomed.set_result(msg)
            elif isinstance(msg, ControlReply):
                fut = self.replies.get(msg.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _heartbeat(self) -> None:
        while True:
            await self._send(self.control_sock, Heartbeat(self.name, self.follower.seq or 0))
            if time.monotonic() - self._coordinator_seen > self.timeout:
                self._fail_all("coordinator is silent: the engine is down")
            await asyncio.sleep(self.interval)

    def _fail_all(self, reason: str) -> None:
        """The engine can no longer finish anything: end every open request with an error."""
        if self.dead_reason is None:
            log.error("gateway.engine_dead", reason=reason)
        self.dead_reason = reason
        for rid, q in self.queues.items():
            error = ErrorInfo("EngineDead", reason)
            q.put_nowait(RequestOutput(rid, [], None, None, True, "error", None, error, 0, 0, 0))
