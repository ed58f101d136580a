"""The coordinator process: numbers control commands, broadcasts them, collects every member's ack,
and watches liveness. Policy lives in bus.control.ControlLedger; this file is the socket loop.

Membership: a member is welcomed once both its Hello (on the ROUTER) and its presence subscription (on
the XPUB) have arrived, so it cannot miss a command published after its Welcome. A member that stops
heartbeating, or whose SUB pipe disconnects, is lost: the coordinator publishes `member_lost` so the
scheduler fails that member's work and pending acks from it are reported missing. A lost member that
comes back (a stall ends, or the launcher restarted it) says Hello again and is welcomed like a new one;
every welcome is followed by a `member_joined` broadcast, so the others resume using it.
"""

from __future__ import annotations

import time
import uuid

import structlog
import zmq

from bus.codec import CodecError
from bus.control import ControlLedger, Member, Pending
from bus.endpoints import COMMAND_TOPIC, WEIGHTS_TOPIC, Endpoints
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    UPDATE_ACTIVE,
    Ack,
    CommandBody,
    CommitWeightUpdate,
    ControlReply,
    ControlRequest,
    ControlState,
    ErrorInfo,
    ErrorKind,
    Heartbeat,
    Hello,
    MemberEntry,
    MemberJoined,
    MemberLost,
    Members,
    Shutdown,
    StartWeightUpdate,
    WeightsLost,
    WeightsMissing,
    WeightsStatus,
    WeightUpdateEvent,
    WeightUpdateResult,
    WeightVersionCommitted,
    WeightVersionLost,
    Welcome,
    describe,
)
from bus.sockets import make_socket, member_name, recv_from, report_ready, send, subscription_event
from engine.config import EngineConfig
from engine.fleet.catch_up import catch_up_config
from engine.fleet.rejoin import starting_state
from engine.logs import setup_logging
from engine.topology import layout, layout_mismatch
from engine.weights.backends import update_struct
from engine.weights.lifecycle import UPDATE_PAUSE_MODES, StepReply, reply_status, sync_steps
from engine.weights.wire import decode_update

log = structlog.get_logger()

NAME = "coordinator"


class Coordinator:
    def __init__(self, cfg: EngineConfig, ep: Endpoints, ctx: zmq.Context):
        self.cfg = cfg
        self.ledger = ControlLedger(snapshot=starting_state(uuid.uuid4().hex, cfg.rl.weights_recovery_dir,
                                                           cfg.rl.weights_recovery_resume, catch_up_config(cfg),
                                                           tuple(cfg.rl.weights_catch_up_peers)))
        self.router = make_socket(ctx, zmq.ROUTER, bind=ep.bind_address(ep.control))
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted member reuses its identity
        self.pub = make_socket(ctx, zmq.XPUB, bind=ep.bind_address(ep.commands))
        self.subscribed: set[str] = set()
        self.hellos: dict[str, Hello] = {}  # waiting for their presence subscription
        self.stopping = False
        self._next_beat = 0.0
        self.weight_cfg = cfg.rl.weight_transfer_config
        self.sync: _Sync | None = None  # the bus-driven weight update in progress
        self.layout = layout(cfg)  # what every engine process must agree on (engine.topology)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        interval = self.cfg.bus.heartbeat_interval_s
        while not (self.stopping and not self.ledger.pending):
            for sock, _ in poller.poll(interval * 1000 / 2):
                if sock is self.pub:
                    self._on_subscription(self.pub.recv())
                else:
                    self._on_router()
            self._tick(time.monotonic())

    # --- inputs ---------------------------------------------------------------------------------

    def _on_subscription(self, frame: bytes) -> None:
        on, topic = subscription_event(frame)
        name = member_name(topic)
        if name is None:
            return
        if on:
            self.subscribed.add(name)
            if name in self.hellos:
                self._welcome(self.hellos.pop(name))
        else:
            self.subscribed.discard(name)
            if name in self.ledger.members:
                self._lose(name, "disconnected")

    def _on_router(self) -> None:
        try:
            sender, msg = recv_from(self.router)
        except CodecError as e:
            log.warning("coordinator.bad_message", error=str(e))
            return
        now = time.monotonic()
        if isinstance(msg, Heartbeat):
            self.ledger.seen(msg.name, now)
        elif isinstance(msg, Ack):
            self.ledger.seen(msg.name, now)
            self._reply(self.ledger.ack(msg))
        elif isinstance(msg, Hello):
            self._on_hello(sender, msg)
        elif isinstance(msg, ControlRequest):
            self._on_request(sender, msg)
        elif isinstance(msg, WeightUpdateEvent):
            self._on_weight_event(sender, msg)

    def _on_hello(self, sender: bytes, h: Hello) -> None:
        if (h.protocol_version, h.protocol_fingerprint) != (PROTOCOL_VERSION, PROTOCOL_FINGERPRINT):
            return self._refuse(sender, h, f"protocol version {h.protocol_version} ({h.protocol_fingerprint}) != "
                                f"coordinator's {PROTOCOL_VERSION} ({PROTOCOL_FINGERPRINT})")
        mismatch = layout_mismatch(self.layout, h.info.layout if h.info is not None else None)
        if mismatch:  # started with other flags (another host's command line, say)
            return self._refuse(sender, h, f"{h.name} was started with other flags than the coordinator: {mismatch}")
        if h.name in self.subscribed:
            self._welcome(h)
        else:
            self.hellos[h.name] = h

    def _refuse(self, sender: bytes, h: Hello, reason: str) -> None:
        log.error("coordinator.refused", member=h.name, reason=reason)
        send(self.router, Welcome(False, reason, self.ledger.seq, ControlState()), to=sender)

    def _welcome(self, h: Hello) -> None:
        """A member joins: new, restarted or back from being lost, it is announced (MemberJoined); a member
        that says Hello again without having left (a resync after a sequence gap) is only welcomed."""
        old = self.ledger.members.get(h.name)
        if old is not None and old.pid != h.pid:  # restarted before its old self was noticed gone
            self._lose(h.name, f"restarted (pid {old.pid} -> {h.pid})")
            old = None
        self.ledger.join(Member(h.name, h.role, h.pid, time.monotonic(), h.info))
        send(self.router, Welcome(True, "", self.ledger.seq, self.ledger.snapshot), to=h.name.encode())
        log.info("coordinator.joined", member=h.name, role=h.role, pid=h.pid, seq=self.ledger.seq)
        if old is None:
            self._publish(MemberJoined(h.name, h.role, h.pid), self.cfg.bus.control_timeout_s)

    def _on_request(self, sender: bytes, r: ControlRequest) -> None:
        if self.stopping:
            send(self.router, ControlReply(r.request_id, False, self.ledger.seq, {},
                                           [ErrorInfo(ErrorKind.SHUTTING_DOWN, "shutting down")]), to=sender)
            return
        if isinstance(r.body, Members):  # read-only: answered directly, not broadcast
            members = {n: MemberEntry(m.role, m.pid, m.info) for n, m in self.ledger.members.items()}
            send(self.router, ControlReply(r.request_id, True, self.ledger.seq, members), to=sender)
            return
        busy = self.sync is not None or self.ledger.snapshot.weight_update_active
        if isinstance(r.body, StartWeightUpdate) and busy:
            # Refused here, not broadcast: a start that reached the workers opens the update window, and
            # its caller must abort it on failure; this one must not touch the update that is active.
            send(self.router, ControlReply(r.request_id, False, self.ledger.seq, {}, [ErrorInfo(
                UPDATE_ACTIVE, "a weight update is already active: finish_weight_update (or its failure) ends it",
                status=409)]), to=sender)
            return
        timeout = r.timeout_s if r.timeout_s > 0 else self.cfg.bus.control_timeout_s
        self._publish(r.body, timeout, r.request_id, sender)
        if isinstance(r.body, Shutdown):
            self.stopping = True

    def _on_weight_event(self, sender: bytes, ev: WeightUpdateEvent) -> None:
        """A trainer announced a weight version: drive the acked steps of engine.weights.lifecycle."""
        def refuse(status: int, error: str) -> None:
            log.warning("coordinator.weight_event_refused", version=ev.version, error=error)
            send(self.router, WeightUpdateResult(ev.request_id, False, ev.version, self.ledger.snapshot.weight_epoch,
                                                 error=ErrorInfo("WeightSyncError", error, status=status)), to=sender)

        if self.weight_cfg is None:
            return refuse(400, "weight transfer is not configured: start the server with --weight-transfer-config")
        if self.sync is not None or self.ledger.snapshot.weight_update_active:
            return refuse(409, "another weight update is in progress")
        mode = ev.pause_mode or self.weight_cfg.pause_mode
        if mode not in UPDATE_PAUSE_MODES:
            return refuse(400, f"pause_mode must be one of {', '.join(UPDATE_PAUSE_MODES)}, got {mode!r}")
        if not ev.updates:
            return refuse(400, "updates must be a non-empty list of update_info objects")
        # the edge's check: a refused update_info travels on as a RefusedUpdate, which its update_weights step
        # fails with (the workers drain the trainer's broadcasts first), so the lifecycle aborts and resumes
        cls = update_struct(self.weight_cfg.backend)
        updates = [decode_update(u, cls) for u in ev.updates]
        timeout = ev.timeout_s if ev.timeout_s > 0 else self.weight_cfg.timeout_s
        steps = sync_steps(ev.version, mode, ev.clear_cache, updates, self.cfg.bus.control_timeout_s,
                           timeout + self.cfg.bus.control_timeout_s)
        self.sync = _Sync(ev, sender, steps)
        log.info("coordinator.weight_update", version=ev.version, pause=mode, updates=len(ev.updates))
        self._advance(None)

    def _advance(self, reply: StepReply | None) -> None:
        s = self.sync
        assert s is not None
        now = time.monotonic()
        if reply is not None:
            s.timings[s.step] = s.timings.get(s.step, 0.0) + now - s.step_started
        try:
            step = s.steps.send(reply) if reply is not None else next(s.steps)
        except StopIteration as stop:
            outcome = stop.value
            self.sync = None
            epoch = self.ledger.snapshot.weight_epoch
            version = self.ledger.snapshot.weight_version
            log.info("coordinator.weight_update_done", ok=outcome.ok, error=outcome.error, epoch=epoch)
            send(self.router, WeightUpdateResult(s.event.request_id, outcome.ok, version, epoch, s.timings,
                                                 outcome.error_info()), to=s.sender)
            return
        s.step, s.step_started = step.name, now
        cmd, done = self.ledger.publish(step.command, now=now, timeout_s=step.timeout_s)
        s.seq = cmd.seq
        send(self.pub, cmd, topic=COMMAND_TOPIC)
        self._reply(done)

    # --- outputs --------------------------------------------------------------------------------

    def _publish(self, command: CommandBody, timeout_s: float, request_id: str = "",
                 requester: bytes | None = None) -> None:
        cmd, done = self.ledger.publish(command, now=time.monotonic(), timeout_s=timeout_s,
                                        request_id=request_id, requester=requester)
        send(self.pub, cmd, topic=COMMAND_TOPIC)
        if isinstance(command, WeightsLost):  # tell the trainers (topic W) that they must send the weights again
            log.error("coordinator.weight_version_lost", version=command.version, member=command.member,
                      why=command.why)
            send(self.pub, WeightVersionLost(self.ledger.snapshot.weights_lost or "", command.epoch, command.member,
                                             command.why, time.time()), topic=WEIGHTS_TOPIC)
        self._reply(done)

    def _reply(self, done: list[Pending]) -> None:
        for p in done:
            if p.ok:
                self._note_weights_missing(p)
            if not p.ok:
                log.warning("coordinator.command_failed", seq=p.seq, command=p.name,
                            error=describe(p.errors, p.missing))
            elif isinstance(p.command, CommitWeightUpdate):  # whoever drove it: tell every subscriber
                snap = self.ledger.snapshot
                send(self.pub, WeightVersionCommitted(snap.weight_version, snap.weight_epoch, time.time()),
                     topic=WEIGHTS_TOPIC)
            if self.sync is not None and p.seq == self.sync.seq:
                self._advance(StepReply(p.ok, describe(p.errors, p.missing),
                                        reply_status(p.ok, p.missing, p.errors), p.results, p.errors))
            if p.requester is not None:
                send(self.router, ControlReply(p.request_id, p.ok, p.seq, p.results, p.errors, p.missing),
                     to=p.requester)

    def _note_weights_missing(self, p: Pending) -> None:
        """Workers report how many parameters a level-2 sleep left without content (sleep, wake, commit,
        reload acks); a change is broadcast as `weights_missing`, before the requester hears back, so the
        gateways refuse requests (503) until every worker has its weights again."""
        counts = [(w.missing, w.total) for r in p.results.values()
                  if isinstance(w := getattr(r, "weights", None), WeightsStatus)]
        if not counts:
            return
        count, total = max(counts)
        snap = self.ledger.snapshot
        if (count, total) != (snap.weights_missing, snap.weights_total) and \
                not (count == 0 and snap.weights_missing == 0):
            self._publish(WeightsMissing(count, total), self.cfg.bus.control_timeout_s)

    def _lose(self, name: str, why: str) -> None:
        member = self.ledger.members.get(name)
        role = member.role if member else "?"
        log.error("coordinator.member_lost", member=name, role=role, why=why)
        self._reply(self.ledger.lose(name))
        self._publish(MemberLost(name, role, why), self.cfg.bus.control_timeout_s)

    def _tick(self, now: float) -> None:
        if now >= self._next_beat:
            send(self.pub, Heartbeat(NAME, self.ledger.seq), topic=COMMAND_TOPIC)
            self._next_beat = now + self.cfg.bus.heartbeat_interval_s
        for name in self.ledger.silent(now, self.cfg.bus.heartbeat_timeout_s):
            self._lose(name, f"no heartbeat for {self.cfg.bus.heartbeat_timeout_s:.1f}s")
        self._reply(self.ledger.expire(now))


class _Sync:
    """A bus-driven weight update: the driver generator and whom to answer."""

    def __init__(self, event: WeightUpdateEvent, sender: bytes, steps) -> None:
        self.event, self.sender, self.steps = event, sender, steps
        self.seq = -1
        self.step = ""
        self.step_started = 0.0
        self.timings: dict[str, float] = {}


def run_coordinator_process(cfg: EngineConfig) -> None:
    setup_logging(cfg.log_level, process=NAME)
    ctx = zmq.Context()
    ep = Endpoints.from_config(cfg).secure(ctx)
    coord = Coordinator(cfg, ep, ctx)
    report_ready(ctx, ep.ready, "coordinator", NAME)
    log.info("coordinator.ready", control=ep.control, commands=ep.commands)
    try:
        coord.run()
    finally:
        ctx.destroy(linger=500)
