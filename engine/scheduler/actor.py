"""The scheduler process: requests in from gateways, step plans out to workers, results back, outputs
out. Policy is engine.scheduler.policy.Scheduler (which sequences run) and engine.scheduler.step_gate.StepGate (whether
a step may run at all); the control state is the follower's (bus.follower); this file only moves
messages. What it sends and counts is built by pure siblings: step_plan.py (the plan), step_results.py (the
steps in flight and their results), outputs.py and routed_pieces.py (what each request is told),
step_metrics.py (the stats every OutputBatch carries), recovery.py (the lost workers and their return).

Start-up: join the control bus, then wait until every worker has both said Hello on the results socket
(with its KV capacity) and subscribed to the plans socket (seen on the XPUB), so the first plan
cannot be lost. One step is in flight at a time (two with async scheduling, below): plan -> results of
every worker -> outputs.

Recovery: a worker declared lost (dead, or stalled past --heartbeat-timeout-s) fails the requests the
workers had seen (503: they were running on it) and stops the stepping; requests still queued wait. The
worker is back once it says Hello on the results socket again, at or after the seq of its loss, with its
plan subscription in place (a restarted one subscribes anew); then steps resume. Queued requests fail
after RECOVERY_WAIT_S (recovery.py) without it. A scheduler that was itself declared lost (a stall) drops all its
requests (the gateways failed them already) and waits for every worker's Hello the same way.

Async scheduling (--async-scheduling, engine.scheduler.policy): up to two steps are in flight. The next plan
is sent while the workers compute the current one, so they start it the moment they finish, without waiting
for the bus hop and the planning; results still come back, and are applied, in step order.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from itertools import repeat
from typing import Any

import structlog
import zmq

from bus import control_state
from bus.codec import CodecError
from bus.endpoints import PLAN_TOPIC, Endpoints
from bus.member import DEFER, MemberLink
from bus.messages import (
    AbortRequests,
    AbortWeightUpdate,
    AddRequest,
    CommandBody,
    CommitWeightUpdate,
    ErrorInfo,
    ErrorKind,
    Health,
    HealthReport,
    Hello,
    MemberJoined,
    MemberLost,
    NotStarted,
    OutputBatch,
    Pause,
    PrefixCacheReset,
    Quiesced,
    RequestOutput,
    ResetPrefixCache,
    Resume,
    SchedulerInfo,
    SchedulerReady,
    Shutdown,
    Sleep,
    StartWeightUpdate,
    StepResult,
    UpdateWeightVersion,
    WakeUp,
    WeightEpoch,
    WorkerInfo,
)
from bus.sockets import make_socket, member_name, recv, recv_from, report_ready, send, subscription_event
from bus.topology import Topology
from engine.block_manager import BlockManager
from engine.config import EngineConfig, async_scheduling_on, prefill_beside_decodes
from engine.config.cache import in_batch_sharing_on, prefix_caching_on
from engine.logs import setup_logging
from engine.request import Sequence
from engine.scheduler.admission import EngineLimits, admission_error
from engine.scheduler.kv_event_publisher import KVEventPublisher
from engine.scheduler.outputs import prompt_tokens, request_output, step_outputs
from engine.scheduler.policy import ScheduledStep, Scheduler, SeqUpdate
from engine.scheduler.recovery import WorkerRecovery
from engine.scheduler.result_check import result_problem
from engine.scheduler.routed_pieces import file_routed
from engine.scheduler.step_gate import Quiesce, StepGate
from engine.scheduler.step_metrics import StepMetrics
from engine.scheduler.step_plan import step_plan
from engine.scheduler.step_results import InFlight, step_error
from engine.state_checkpoints import StateCheckpoints
from engine.topology import layout
from engine.window_blocks import WindowBlocks

log = structlog.get_logger()

NAME = "scheduler"


class SchedulerActor:
    def __init__(self, cfg: EngineConfig, ep: Endpoints, ctx: zmq.Context):
        self.cfg = cfg
        # Which engine we are (data parallelism, bus.topology): our name and our workers' names
        topo = Topology.from_config(cfg)
        self.engine = cfg.parallel.data_parallel_rank
        self.name = topo.scheduler_name(self.engine)
        self.workers = topo.worker_names(self.engine)
        self.num_workers = len(self.workers)
        self.router = make_socket(ctx, zmq.ROUTER, bind=ep.bind_address(ep.requests))
        self.plans = make_socket(ctx, zmq.XPUB, bind=ep.bind_address(ep.plans))
        self.results = make_socket(ctx, zmq.PULL, bind=ep.bind_address(ep.results))
        self.link = MemberLink(ctx, ep, role="scheduler", name=self.name, info=SchedulerInfo(layout(cfg)), handlers={
            Health: self._health, Shutdown: self._shutdown, MemberLost: self._member_lost,
            MemberJoined: lambda c: None,  # a worker is back only once its Hello reaches us (recovery.py)
            UpdateWeightVersion: self._new_epoch, CommitWeightUpdate: self._new_epoch,
            ResetPrefixCache: self._reset_prefix_cache,
            **dict.fromkeys((Pause, Resume, Sleep, WakeUp, StartWeightUpdate, AbortWeightUpdate), self._gate_command),
        }, heartbeat_interval_s=cfg.bus.heartbeat_interval_s, heartbeat_timeout_s=cfg.bus.heartbeat_timeout_s)
        kv_events = cfg.cache.kv_events_config
        self.kv_events = KVEventPublisher(kv_events, ctx, self.engine) if kv_events and kv_events.publishing else None
        self.gate = StepGate()
        self.sched: Scheduler | None = None  # built once the workers report their KV capacity
        self.stopping = False
        self.step_id = 0
        # Steps sent and not answered yet, with their results so far. At most `depth`: 1, or 2 with async
        # scheduling (the next plan waits at the workers while one computes).
        self.in_flight = InFlight(self.num_workers)
        self.depth = 1  # 2 with async scheduling, decided once the workers say what device they run on
        self.plan_ahead_idle = False  # async: the last look-ahead planned nothing; wait for news before the next
        self.metrics = StepMetrics()
        # The updates of the step whose results came in this loop turn (and its result), whose outputs are
        # built after the next plan is sent (turn())
        self.step_outputs: tuple[ScheduledStep, list[SeqUpdate], StepResult] | None = None
        # Outputs of this loop turn, sent once the turn's plan is out (the workers wait for the plan; the
        # gateways can wait the fraction of a millisecond): one OutputBatch per gateway per turn, in order.
        self.outbox: list[tuple[Sequence, RequestOutput]] = []
        # Recovery: workers lost and not back, each worker's last Hello and who is subscribed to the plans
        self.recovery = WorkerRecovery()

    # --- start-up -------------------------------------------------------------------------------

    def wait_for_workers(self, timeout_s: float = 600.0) -> SchedulerReady:
        """Every worker's Hello (results socket) and plan subscription (XPUB) must both arrive."""
        want = set(self.workers)
        hellos: dict[str, Hello] = {}
        subscribed: set[str] = set()
        poller = zmq.Poller()
        for s in (self.plans, self.results, *self.link.sockets):
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not (want <= set(hellos) and want <= subscribed):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout_s:.0f}s: {sorted(want - set(hellos))}")
            for sock, _ in poller.poll(200):
                if sock is self.plans:
                    on, topic = subscription_event(self.plans.recv())
                    name = member_name(topic)
                    if on and name is not None:
                        subscribed.add(name)
                    self.recovery.on_plan_subscription(on, name)
                elif sock is self.results:
                    try:
                        msg = recv(self.results)
                    except CodecError as e:
                        log.warning("scheduler.bad_result", error=str(e))
                        continue
                    if isinstance(msg, Hello) and isinstance(msg.info, WorkerInfo):
                        hellos[msg.name] = msg
                        self.recovery.on_worker_hello(msg)
                else:
                    self.link.handle(sock)
            self.link.tick(time.monotonic())
        infos = [hellos[n].info for n in sorted(want)]
        num_blocks = min(i.num_blocks for i in infos)
        max_len = min(i.max_model_len for i in infos)
        self.max_model_len = max_len
        self.depth = 2 if async_scheduling_on(self.cfg.scheduler, infos[0].device) else 1
        self.limits = EngineLimits(min(i.vocab_size for i in infos), max_len, self.cfg.model.max_logprobs,
                                   self.cfg.rl.enable_trace_replay, self.cfg.scheduler.scheduling_policy)
        state_slots = min(i.state_slots for i in infos)
        checkpoints = min(i.state_checkpoints for i in infos)
        caching = prefix_caching_on(self.cfg.cache, state_slots, checkpoints)
        if caching != self.cfg.cache.enable_prefix_caching:
            log.info("scheduler.prefix_caching_off", reason="hybrid model: the KV-cache budget left no room for "
                     "recurrent-state checkpoints, so a prefix hit could not be resumed")
        window = min(i.kv_window for i in infos)
        window_blocks = min(i.window_blocks for i in infos)
        blocks = BlockManager(num_blocks, self.cfg.cache.block_size, caching,
                              record_events=self.kv_events is not None,
                              windows=WindowBlocks(window_blocks, self.cfg.cache.block_size, window)
                              if window_blocks else None,
                              checkpoints=StateCheckpoints(checkpoints) if state_slots and caching else None)
        self.sched = Scheduler(blocks,
                               self.cfg.scheduler.max_num_seqs, self.cfg.scheduler.max_num_batched_tokens, max_len,
                               max_loras=self.cfg.lora.max_loras if self.cfg.lora.enable_lora else 0,
                               policy=self.cfg.scheduler.scheduling_policy, state_slots=state_slots,
                               checkpoint_every=self.cfg.cache.mamba_block_size or 0,
                               window=window,
                               in_batch_sharing=in_batch_sharing_on(self.cfg.cache, state_slots, checkpoints),
                               prefill_beside_decodes=prefill_beside_decodes(self.cfg.scheduler, infos[0].device),
                               long_prefill_token_threshold=self.cfg.scheduler.long_prefill_token_threshold,
                               long_prefill_adaptive=self.cfg.scheduler.long_prefill_token_threshold_adaptive)
        # Start from the control state every other member is in (the Welcome snapshot plus whatever
        # was broadcast while we waited for the workers).
        self.sched.weight_epoch = self.link.state.weight_epoch
        self.gate = StepGate.from_state(self.link.state)
        log.info("scheduler.workers_ready", workers=len(want), num_blocks=num_blocks, max_model_len=max_len,
                 async_scheduling=self.depth > 1)
        return SchedulerReady(num_blocks, max_len, self.depth > 1)

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.router, self.results, self.plans, *self.link.sockets):
            poller.register(s, zmq.POLLIN)
        idle_ms = self.cfg.bus.heartbeat_interval_s * 1000 / 2
        while not self.stopping:
            self.turn(poller, idle_ms)

    def turn(self, poller: zmq.Poller, idle_ms: float) -> None:
        """One loop turn: what arrived, then the next plan if a step may start, then this turn's outputs."""
        busy = self._can_start_step()
        events = poller.poll(0 if busy else idle_ms)
        if events:
            self.plan_ahead_idle = False  # a request, a result or a command may give a look-ahead work
        for sock, _ in events:
            if self.step_outputs is not None:
                self._build_step_outputs()  # a step's outputs go before whatever came after its results
            if sock is self.router:
                self._on_request()
            elif sock is self.results:
                self._on_result()
            elif sock is self.plans:
                on, topic = subscription_event(self.plans.recv())
                self.recovery.on_plan_subscription(on, member_name(topic))
            else:
                self.link.handle(sock)
        self.link.tick(time.monotonic())
        if self.step_outputs is not None and (self.gate.pending is not None or self.recovery.waiting):
            self._build_step_outputs()  # a quiesce or a recovery wait may drop the sequences they describe
        if self.recovery.waiting:
            self._check_recovery_wait()
        self._maybe_complete_quiesce()
        if self._can_start_step():
            self._start_step()
        if self.step_outputs is not None:
            self._build_step_outputs()  # after the plan: the workers compute while we build them
        self.metrics.no_plan_followed()
        if self.kv_events is not None and self.sched.blocks.events:
            # before the outputs, as vLLM: a client that reads a finished request and sends the next turn
            # finds its blocks announced already
            self.kv_events.publish(self.sched.blocks.take_events())
        if self.outbox:
            self._flush()

    def _can_start_step(self) -> bool:
        if self.in_flight and self.plan_ahead_idle:
            return False
        return not self.recovery.waiting and self.gate.may_step(
            self.link.state, in_flight=len(self.in_flight) >= self.depth, has_work=self.sched.has_work())

    def _on_request(self) -> None:
        try:
            client, msg = recv_from(self.router)
        except CodecError as e:
            log.warning("scheduler.bad_message", error=str(e))
            return
        if isinstance(msg, AddRequest):
            self._add(client, msg)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                seq = self.sched.abort(rid)
                if seq is not None:
                    self._emit([(seq, request_output(seq, [], finished=True))])

    def _add(self, client: bytes, msg: AddRequest) -> None:
        seq = Sequence(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.eos_token_ids, msg.arrival_time,
                       client)
        error = None
        if self.recovery.waited_too_long():
            error = ErrorInfo(ErrorKind.WORKER_LOST, self.recovery.message(), status=503)
        if error is None and control_state.rejects_new_requests(self.link.state):
            error = ErrorInfo(ErrorKind.PAUSED, control_state.PAUSED_MESSAGE, status=503)
        if error is None and msg.request_id in self.sched.seqs:
            error = ErrorInfo(ErrorKind.DUPLICATE_REQUEST, f"request id {msg.request_id!r} is already running",
                              param="request_id")
        if error is None:
            error = admission_error(msg, self.limits)  # nothing a worker cannot run reaches a step
        if error is not None:
            seq.finish_reason = "error"
            self._emit([(seq, request_output(seq, [], finished=True, error=error))])
            return
        self.sched.add(seq)

    def _start_step(self) -> None:
        step = self.sched.schedule()
        if not step.seqs:
            if step.finished_ids:  # nothing to run, but let workers forget finished sequences
                self._publish(step)
            self.plan_ahead_idle = bool(self.in_flight)  # what is left is in flight: plan again after news
            return
        self._publish(step)
        self.in_flight.sent(self.step_id, step, time.perf_counter())

    def _publish(self, step: ScheduledStep) -> None:
        self.step_id += 1
        send(self.plans, step_plan(self.step_id, step, self.sched), topic=PLAN_TOPIC)
        self.metrics.plan_sent()

    def _on_result(self) -> None:
        arrived, cpu = time.perf_counter(), time.thread_time()  # the turnaround counts decoding and checking too
        try:
            res = recv(self.results)
        except CodecError as e:
            log.warning("scheduler.bad_result", error=str(e))
            return
        if isinstance(res, Hello):
            self.recovery.on_worker_hello(res)
            return
        if not isinstance(res, StepResult):
            return
        step = self.in_flight.step(res.step_id)
        if step is None:
            return  # a step failed or forgotten (a worker was lost): nothing waits for it
        why = result_problem(res, step, self.num_workers)
        if why is not None:  # well-typed but not an answer to this step: the real one is still to come
            log.warning("scheduler.bad_result", step=res.step_id, rank=res.rank, error=why)
            return
        # one tp worker may answer the next step before another answers this one: kept until its turn
        self.in_flight.add(res)
        while self.in_flight.oldest_answered():
            if self.step_outputs is not None:
                self._build_step_outputs()  # the outputs of the step before go first
            self._complete_step(arrived, cpu)

    def _complete_step(self, arrived: float, cpu: float) -> None:
        """Apply the oldest step in flight, whose results from every worker are in."""
        step, sent, results = self.in_flight.pop()
        started = self.metrics.results_in(sent, arrived, cpu, idle=not self.in_flight)
        main = results[0]
        error = step_error(results)
        interrupted = any(r.interrupted for r in results.values())
        if error is not None:
            # A step that raised (a bug, or out of memory) fails the requests in it; the engine
            # keeps serving the others. Dead workers are handled by member_lost, not here.
            self._fail_seqs(step.seqs, error)
            self.sched.discard_saves(step)
            return
        if interrupted:
            self.sched.discard_saves(step)
            # An abort pause cut the step short: its sequences were aborted, nothing advanced.
            self._maybe_complete_quiesce()
            return
        self.metrics.step_done(started, main.step_time_s)
        if main.routed_experts is not None:
            file_routed(step, main)
        for sid, error in main.seq_errors:  # one request failed alone (structured outputs): the rest go on
            seq = self.sched.seqs.get(sid)
            if seq is not None:
                self._fail_seqs([seq], error)
        sampled = dict(zip(main.seq_ids, zip(main.token_ids.tolist(), main.logprobs.tolist(), repeat(None))))
        updates = self.sched.update(step, sampled)  # the stop rules: before the next schedule
        self.metrics.counters["generation_tokens"] += len(updates)
        # Their outputs are built once the next plan is out (turn()), or before anything else the loop
        # handles first: what they say is what the update left (kv_epoch is in the update).
        self.step_outputs = (step, updates, main)

    def _build_step_outputs(self) -> None:
        """The outputs of the step whose results came in, and its prompt-token count (read by stats())."""
        step, updates, res = self.step_outputs
        self.step_outputs = None
        self.metrics.counters["prompt_tokens"] += prompt_tokens(step)
        self._emit(step_outputs(updates, res))

    # --- outputs --------------------------------------------------------------------------------

    def _emit(self, items: list[tuple[Sequence, RequestOutput]]) -> None:
        """Queue outputs for the end of this loop turn (run() flushes them after the turn's plan)."""
        self.outbox += items

    def _flush(self) -> None:
        """One OutputBatch per gateway that owns any of the queued outputs."""
        items, self.outbox = self.outbox, []
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for seq, out in items:
            by_client[seq.client].append(out)
        stats = self.stats()
        for client, outs in by_client.items():
            send(self.router, OutputBatch(outs, stats), to=client)

    def stats(self) -> dict[str, float]:
        return self.metrics.stats(self.sched)

    # --- control (handlers of the typed commands; the follower has applied the state already) ------

    def _health(self, cmd: Health) -> HealthReport:
        if self.sched is None:
            return HealthReport(False, "waiting for workers")
        if self.recovery.waiting:
            return HealthReport(False, f"waiting for {', '.join(sorted(self.recovery.waiting))} to rejoin")
        return HealthReport(True, running=len(self.sched.running))

    def _shutdown(self, cmd: Shutdown) -> None:
        self.stopping = True

    def _member_lost(self, cmd: MemberLost) -> None:
        seq = self.link.follower.current.seq
        if cmd.role == "worker" and cmd.name in self.workers:  # another engine's worker is its scheduler's business
            self._worker_lost([cmd.name], seq, ErrorInfo(
                ErrorKind.WORKER_LOST, f"{cmd.name} was lost ({cmd.why}) while this request ran on it; retry",
                cmd.name, 503))
        elif cmd.name == self.name:
            # We stalled past the heartbeat timeout: the gateways failed our requests already, and the
            # workers forget their sequences when we rejoin (MemberJoined): start again from nothing.
            log.warning("scheduler.was_lost", why=cmd.why)
            self._worker_lost(list(self.workers), seq, ErrorInfo(
                ErrorKind.SCHEDULER_LOST, f"the scheduler was lost ({cmd.why})", self.name, 503), everything=True)
        elif cmd.role == "gateway" and self.sched is not None:
            # Nobody is left to read these outputs: stop computing them.
            orphans = [s for s in self.sched.seqs.values() if s.client == cmd.name.encode()]
            for seq in orphans:
                self.sched.abort(seq.seq_id)
            if orphans:
                log.warning("scheduler.aborted_orphans", gateway=cmd.name, count=len(orphans))

    def _worker_lost(self, names: list[str], seq: int, error: ErrorInfo, everything: bool = False) -> None:
        """Stop stepping until `names` say Hello again; fail what the workers had seen (their state of it is
        gone: sampled tokens, per-request generators, KV), keep the rest queued."""
        log.error("scheduler.worker_lost", workers=names, seq=seq, reason=error.message)
        self.recovery.lost(names, seq)
        if self.sched is None:
            return  # still starting: wait_for_workers waits for the Hellos anyway
        self.in_flight.clear()
        seqs = [q for q in self.sched.seqs.values() if everything or q.sent_to_workers]
        self._fail_seqs(seqs, error)
        self.sched.blocks.reset_prefix_cache()  # a restarted worker's KV cache holds nothing
        for n in names:
            self.recovery.check_rejoined(n)  # its Hello may have overtaken the news of its loss

    def _check_recovery_wait(self) -> None:
        """Queued requests do not wait forever for a worker that never comes back."""
        if self.sched is None or not self.recovery.waited_too_long() or not self.sched.seqs:
            return
        self._fail_seqs(list(self.sched.seqs.values()),
                        ErrorInfo(ErrorKind.WORKER_LOST, self.recovery.message(), status=503))

    def _reset_prefix_cache(self, cmd: ResetPrefixCache) -> PrefixCacheReset:
        if self.sched is None:
            return PrefixCacheReset(False)  # nothing cached before the workers are up; retry then
        return PrefixCacheReset(self.sched.reset_prefix_cache(cmd.reset_running_requests))

    def _new_epoch(self, cmd: UpdateWeightVersion | CommitWeightUpdate) -> WeightEpoch | NotStarted:
        """A new weight epoch: new prefix-cache key space too. A commit also ends the update's window."""
        if self.sched is None:
            return NotStarted()  # wait_for_workers starts from the state
        self.sched.weight_epoch = self.link.state.weight_epoch
        if isinstance(cmd, CommitWeightUpdate):
            self._gate_command(cmd)
        return WeightEpoch(self.sched.weight_epoch)

    def _gate_command(self, cmd: CommandBody) -> Any:
        if self.sched is None:
            return NotStarted()  # wait_for_workers builds the gate from the state
        f = self.link.follower
        verdict = self.gate.on_command(cmd, f.before, f.state)
        if not isinstance(verdict, Quiesce):
            return verdict
        if verdict.mode == "abort":
            aborted = self.sched.abort_all()
            verdict.aborted = len(aborted)
            self._emit([(seq, request_output(seq, [], finished=True)) for seq in aborted])
        done = self._complete_quiesce()
        return DEFER if done is None else done

    def _complete_quiesce(self) -> Quiesced | None:
        """The ack's result once the pending quiesce is complete (no step in flight, and for wait no work
        left), else None."""
        q = self.gate.quiesced(in_flight=bool(self.in_flight), has_work=self.sched.has_work())
        if q is None:
            return None
        if q.clear_cache:
            self.sched.drop_kv()
        if q.keep_kv:  # the workers copy these blocks to the host before releasing the KV cache
            return Quiesced(q.aborted, kv_blocks=self.sched.keep_kv())
        return Quiesced(q.aborted)

    def _maybe_complete_quiesce(self) -> None:
        if self.gate.pending is None:
            return
        done = self._complete_quiesce()
        if done is not None and self.link.deferred is not None:
            self.link.complete(done)

    def _fail_seqs(self, seqs: list[Sequence], reason: ErrorInfo) -> None:
        outs = []
        for seq in seqs:
            if self.sched.abort(seq.seq_id) is None:
                continue
            seq.finish_reason = "error"
            outs.append((seq, request_output(seq, [], finished=True, error=reason)))
        self._emit(outs)


def freeze_heap() -> None:
    """After start-up: collect once, then move every surviving object (modules, the block manager's free
    lists, ...) out of the collector's sight, so a full collection in the loop walks only what the loop
    made (vLLM's freeze_gc_heap). A full collection of the start-up heap took 10-20 ms here, between a
    step's results and the next plan."""
    gc.collect()
    gc.freeze()


def run_scheduler_process(cfg: EngineConfig) -> None:
    setup_logging(cfg.log_level, process=Topology.from_config(cfg).scheduler_name(cfg.parallel.data_parallel_rank))
    ctx = zmq.Context()
    ep = Endpoints.from_config(cfg).secure(ctx)
    actor = SchedulerActor(cfg, ep, ctx)
    try:
        actor.link.wait_welcome(timeout_s=120)
        info = actor.wait_for_workers()
        freeze_heap()
        report_ready(ctx, ep.ready, "scheduler", actor.name, info)
        actor.run()
    finally:
        if actor.kv_events is not None:
            actor.kv_events.close()
        actor.link.close()
        ctx.destroy(linger=500)
