"""The scheduler process: requests in from gateways, step plans out to workers, results back, outputs
out. Policy is engine.scheduler.Scheduler; this file only moves messages.

Start-up: join the control bus, then wait until every worker has both said Hello on the results socket
(with its KV capacity) and subscribed to the plans socket (seen on the XPUB), so the first plan
cannot be lost. One step is in flight at a time: plan -> results of every worker -> outputs.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from typing import Any

import structlog
import zmq

from bus.codec import CodecError
from bus.endpoints import PLAN_TOPIC, Endpoints
from bus.member import DEFER, MemberLink
from bus.messages import (
    AbortRequests,
    AddRequest,
    Command,
    Hello,
    NewSeq,
    OutputBatch,
    PromptLogprobs,
    RequestOutput,
    StepPlan,
    StepResult,
)
from bus.sockets import make_socket, recv, recv_from, report_ready, send, subscription_event
from engine import control_state
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.logs import setup_logging
from engine.request import SeqStatus, Sequence
from engine.routed_experts import merge as merge_routed
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep, Scheduler, SeqUpdate

log = structlog.get_logger()

NAME = "scheduler"


class SchedulerActor:
    def __init__(self, cfg: EngineConfig, ep: Endpoints, ctx: zmq.Context):
        self.cfg = cfg
        self.router = make_socket(ctx, zmq.ROUTER, bind=ep.bind_address(ep.requests))
        self.plans = make_socket(ctx, zmq.XPUB, bind=ep.bind_address(ep.plans))
        self.results = make_socket(ctx, zmq.PULL, bind=ep.bind_address(ep.results))
        self.link = MemberLink(ctx, ep, role="scheduler", name=NAME, apply=self._apply,
                               heartbeat_interval_s=cfg.heartbeat_interval_s,
                               heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.sched: Scheduler | None = None  # built once the workers report their KV capacity
        self.dead_reason: str | None = None
        self.stopping = False
        self.step_id = 0
        self.in_flight: ScheduledStep | None = None
        self.pending_results: dict[int, StepResult] = {}
        self.step_started = 0.0
        self.step_time_ema = 0.0
        self.counters = defaultdict(float)
        self._control: dict[str, Any] | None = None
        self._control_welcome = 0
        self.pause_pending: dict[str, Any] | None = None  # a deferred pause waiting to complete
        self.sleep_paused = False  # the scheduler is quiet because of a sleep, not a user pause

    @property
    def control(self) -> dict[str, Any]:
        """Our copy of the control state: the Welcome snapshot, then every stateful command applied in
        order (commands replayed right after the Welcome included)."""
        if self._control is None or self._control_welcome != self.link.welcomes:
            # first use, or a resync after a sequence gap brought a fresh snapshot
            self._control = copy.deepcopy(self.link.snapshot) or control_state.initial_state()
            self._control_welcome = self.link.welcomes
        return self._control

    # --- start-up -------------------------------------------------------------------------------

    def wait_for_workers(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Every worker's Hello (results socket) and plan subscription (XPUB) must both arrive."""
        want = {f"worker-{r}" for r in range(self.cfg.num_workers)}
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
                    if on and topic.startswith(b"@"):
                        subscribed.add(topic[1:].decode())
                elif sock is self.results:
                    msg = recv(self.results)
                    if isinstance(msg, Hello):
                        hellos[msg.name] = msg
                else:
                    self.link.handle(sock)
            self.link.tick(time.monotonic())
        infos = [hellos[n].info for n in sorted(want)]
        num_blocks = min(i["num_blocks"] for i in infos)
        max_len = min(i["max_model_len"] for i in infos)
        self.max_model_len = max_len
        self.sched = Scheduler(BlockManager(num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching),
                               self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, max_len)
        # Start from the control state every other member is in (the Welcome snapshot plus whatever
        # was broadcast while we waited for the workers).
        self.sched.weight_version = int(self.control.get("weight_epoch", 0))
        paused = self.control.get("paused")
        if paused:
            self.sched.pause(paused["mode"], paused["clear_cache"])
        elif self.control.get("sleeping_tags"):
            self.sched.pause("keep", True)
            self.sleep_paused = True
        elif self.control.get("weight_update_active"):
            self.sched.pause("keep", False)
        log.info("scheduler.workers_ready", workers=len(want), num_blocks=num_blocks, max_model_len=max_len)
        return {"num_blocks": num_blocks, "max_model_len": max_len}

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.router, self.results, *self.link.sockets):
            poller.register(s, zmq.POLLIN)
        idle_ms = self.cfg.heartbeat_interval_s * 1000 / 2
        while not self.stopping:
            busy = self._can_start_step()
            for sock, _ in poller.poll(0 if busy else idle_ms):
                if sock is self.router:
                    self._on_request()
                elif sock is self.results:
                    self._on_result()
                else:
                    self.link.handle(sock)
            self.link.tick(time.monotonic())
            self._maybe_complete_pause()
            if self._can_start_step():
                self._start_step()

    def _can_start_step(self) -> bool:
        return (self.in_flight is None and self.sched.has_work() and not self.dead_reason
                and self.sched.can_step() and not self.control.get("sleeping_tags"))

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
                    self._emit([(seq, self._output(seq, [], finished=True))])

    def _add(self, client: bytes, msg: AddRequest) -> None:
        seq = Sequence(msg.request_id, msg.prompt_token_ids, SamplingParams.from_wire(msg.sampling),
                       msg.eos_token_ids, msg.arrival_time, client)
        error = self.dead_reason
        if error is None and control_state.rejects_new_requests(self.control):
            error = control_state.PAUSED_MESSAGE
        if error is None and msg.request_id in self.sched.seqs:
            error = f"request id {msg.request_id!r} is already running"
        if error is None and seq.num_prompt_tokens >= self.max_model_len:
            error = f"prompt of {seq.num_prompt_tokens} tokens does not fit max_model_len {self.max_model_len}"
        if error is not None:
            seq.finish_reason = "error"
            self._emit([(seq, self._output(seq, [], finished=True, error=error))])
            return
        self.sched.add(seq)

    def _start_step(self) -> None:
        step = self.sched.schedule()
        if not step.seqs:
            if step.finished_ids:  # nothing to run, but let workers forget finished sequences
                self._publish(step)
            return
        self._publish(step)
        self.in_flight = step
        self.step_started = time.perf_counter()

    def _publish(self, step: ScheduledStep) -> None:
        self.step_id += 1
        plan = StepPlan(
            self.step_id,
            [NewSeq(s.seq_id, s.prompt_token_ids, s.sampling.to_wire(), s.eos_token_ids) for s in step.new_seqs],
            [s.seq_id for s in step.seqs], step.num_computed, step.num_new,
            [s.block_table for s in step.seqs], step.finished_ids, step.weight_version)
        send(self.plans, plan, topic=PLAN_TOPIC)

    def _on_result(self) -> None:
        try:
            res = recv(self.results)
        except CodecError as e:
            log.warning("scheduler.bad_result", error=str(e))
            return
        if not isinstance(res, StepResult) or self.in_flight is None or res.step_id != self.step_id:
            return
        self.pending_results[res.rank] = res
        if len(self.pending_results) < self.cfg.num_workers:
            return
        step, self.in_flight = self.in_flight, None
        main = self.pending_results[0]
        errors = [r.error for r in self.pending_results.values() if r.error]
        self.pending_results = {}
        if errors and all(e == "interrupted" for e in errors):
            # An abort pause cut the step short: its sequences were aborted, nothing advanced.
            self._maybe_complete_pause()
            return
        if errors:
            # A step that raised (a bug, or out of memory) fails the requests in it; the engine
            # keeps serving the others. Dead workers are handled by member_lost, not here.
            self._fail_seqs(step.seqs, f"worker step failed: {errors[0]}")
            return
        dt = time.perf_counter() - self.step_started
        self.step_time_ema = dt if not self.step_time_ema else 0.9 * self.step_time_ema + 0.1 * dt
        self.counters["steps"] += 1
        self.counters["step_time_total"] += dt
        # the worker's own compute time: step_time_total - step_compute_total is what the bus hop costs
        self.counters["step_compute_total"] += main.step_time_s
        self.counters["prompt_tokens"] += sum(max(0, min(b + n, q.num_prompt_tokens) - b)
                                              for q, n, b in zip(step.seqs, step.num_new, step.num_computed))
        if main.routed_experts is not None:
            self._file_routed(step, main)
        sampled: dict[str, tuple[int, float, list[list[float]] | None]] = {}
        row: dict[str, int] = {}
        for i, sid in enumerate(main.seq_ids):
            sampled[sid] = (int(main.token_ids[i]), float(main.logprobs[i]), None)
            row[sid] = i
        updates = self.sched.update(step, sampled)
        self.counters["generation_tokens"] += len(updates)
        prompt_lps = {p.seq_id: p for p in main.prompt_logprobs}
        self._emit([(u.seq, self._update_output(u, main, row[u.seq.seq_id], prompt_lps.get(u.seq.seq_id)))
                    for u in updates])

    def _file_routed(self, step: ScheduledStep, res: StepResult) -> None:
        """Routed experts of this step, filed as numpy views under their sequences until their next output
        (a partial prefill chunk has none). Sequences aborted while the step ran drop theirs."""
        seqs = {s.seq_id: s for s in step.seqs}
        rows = res.routed_experts
        for sid, start, first, n in res.routed_spans or ():
            seq = seqs.get(sid)
            if seq is not None and seq.status is not SeqStatus.FINISHED:
                seq.routed_pieces.append((start, rows[first:first + n]))

    # --- outputs --------------------------------------------------------------------------------

    def _update_output(self, u: SeqUpdate, res: StepResult, i: int, prompt_lp: PromptLogprobs | None
                       ) -> RequestOutput:
        """One sampled token of one sequence, with what the request asked to know about it."""
        sp = u.seq.sampling
        want_lp = sp.logprobs is not None
        top = None
        if want_lp and sp.logprobs:
            k = None if sp.logprobs == -1 else sp.logprobs  # -1: every column the worker computed (the vocab)
            top = [[[int(t), float(lp)] for t, lp in zip(res.topk_ids[i, :k], res.topk_logprobs[i, :k])]]
        version = res.weight_version
        out = self._output(u.seq, [u.token_id], finished=u.finished,
                           logprobs=[u.logprob] if want_lp else None, top=top, version=version)
        out.stale_kv = u.seq.kv_epoch is not None and u.seq.kv_epoch != version
        if want_lp and res.ranks is not None:
            out.ranks = [int(res.ranks[i])]
        if sp.return_sampling_mass and res.sampling_mass is not None:
            out.sampling_mass = [float(res.sampling_mass[i])]
        out.prompt_logprobs = prompt_lp
        return out

    def _output(self, seq: Sequence, tokens: list[int], *, finished: bool, error: str | None = None,
                logprobs: list[float] | None = None, top: list | None = None, version: int = 0) -> RequestOutput:
        out = RequestOutput(seq.seq_id, tokens, logprobs, top, finished,
                            seq.finish_reason if finished else None, seq.stop_reason if finished else None,
                            error, seq.num_prompt_tokens, seq.num_cached_tokens, version)
        if seq.routed_pieces:  # every output carries the routes computed since the previous one
            out.routed_experts_start, out.routed_experts = merge_routed(seq.routed_pieces)
            seq.routed_pieces = []
        return out

    def _emit(self, items: list[tuple[Sequence, RequestOutput]]) -> None:
        """One OutputBatch per gateway that owns any of these outputs."""
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for seq, out in items:
            by_client[seq.client].append(out)
        stats = self.stats()
        for client, outs in by_client.items():
            send(self.router, OutputBatch(outs, stats), to=client)

    def stats(self) -> dict[str, float]:
        b = self.sched.blocks
        return {"num_running": len(self.sched.running), "num_waiting": len(self.sched.waiting),
                "kv_usage": b.usage, "step_time_s": self.step_time_ema,
                "num_preemptions": self.sched.num_preemptions,
                "prefix_cache_queries": b.num_prefix_queries, "prefix_cache_hits": b.num_prefix_hits,
                **self.counters}

    # --- control --------------------------------------------------------------------------------

    def _apply(self, cmd: Command) -> dict[str, Any] | None:
        if self.sched is None and cmd.command in control_state.REDUCERS:
            control_state.apply(self.control, cmd.command, cmd.args)  # applied when the workers are up
            return {"starting": True}
        if cmd.command == "health":
            if self.sched is None:
                return {"ok": False, "why": "waiting for workers"}
            return {"ok": self.dead_reason is None, "running": len(self.sched.running)}
        if cmd.command == "shutdown":
            self.stopping = True
            return None
        if cmd.command in ("pause", "resume"):
            return self._apply_pause(cmd)
        if cmd.command in ("sleep", "wake_up"):
            return self._apply_sleep(cmd)
        if cmd.command in control_state.WEIGHT_UPDATE_COMMANDS:
            return self._apply_weight_update(cmd)
        if cmd.command == "update_weight_version":
            control_state.apply(self.control, cmd.command, cmd.args)
            self.sched.weight_version = self.control["weight_epoch"]  # new prefix-cache key space too
            return {"weight_epoch": self.sched.weight_version}
        if cmd.command == "reset_prefix_cache":
            return {"success": self.sched.reset_prefix_cache(bool(cmd.args.get("reset_running_requests")))}
        if cmd.command == "member_lost":
            role, name = cmd.args.get("role"), str(cmd.args.get("name"))
            if role == "worker":
                self._fail_all(f"{name} died ({cmd.args.get('why')})")
            elif role == "gateway" and self.sched is not None:
                # Nobody is left to read these outputs: stop computing them.
                orphans = [s for s in self.sched.seqs.values() if s.client == name.encode()]
                for seq in orphans:
                    self.sched.abort(seq.seq_id)
                if orphans:
                    log.warning("scheduler.aborted_orphans", gateway=name, count=len(orphans))
        return None

    def _apply_pause(self, cmd: Command) -> Any:
        was_paused = self.control.get("paused") is not None
        control_state.apply(self.control, cmd.command, cmd.args)
        if cmd.command == "resume":
            if not self.control.get("sleeping_tags") and not self.control.get("weight_update_active"):
                self.sched.resume()
            self.sleep_paused = False
            return {"paused": False}
        if was_paused:
            return {"paused": True}  # pausing twice: a no-op
        if self.sched.paused_mode is not None:  # already quiet because of a sleep
            self.sleep_paused = False  # the user's pause now holds it after the wake
            return {"paused": True}
        return self._quiesce(cmd.args["mode"], bool(cmd.args.get("clear_cache", True)))

    def _apply_sleep(self, cmd: Command) -> Any:
        """Sleep pauses like /pause (mode), except that new requests queue; levels 1 and 2 drop the KV
        of kept requests, since the workers are about to discard it. Wake resumes once no tag sleeps."""
        was_asleep = bool(self.control.get("sleeping_tags"))
        control_state.apply(self.control, cmd.command, cmd.args)
        if cmd.command == "wake_up":
            if not self.control["sleeping_tags"] and self.sleep_paused:
                self._resume_if_free()
            return {"sleeping_tags": self.control["sleeping_tags"]}
        if was_asleep or self.sched.paused_mode is not None:
            return {"sleeping": True}  # asleep already, or held by a user pause: nothing to quiesce
        self.sleep_paused = True
        return self._quiesce(cmd.args["mode"], int(cmd.args["level"]) >= 1)

    def _apply_weight_update(self, cmd: Command) -> Any:
        """From start_weight_update until its commit or abort no step runs, so no token is computed on
        half-written weights (requests queue, running ones keep their KV, as a keep pause). Commit
        moves the prefix cache to the new epoch's key space."""
        control_state.apply(self.control, cmd.command, cmd.args)
        if cmd.command == "start_weight_update":
            if self.sched.paused_mode is not None:
                return {"held": True}  # already quiet: a pause or a sleep holds it
            return self._quiesce("keep", False)
        if cmd.command in ("commit_weight_update", "abort_weight_update"):
            self.sched.weight_version = int(self.control["weight_epoch"])
            self._resume_if_free()
            return {"weight_epoch": self.sched.weight_version}
        return None  # the data path is the workers' business

    def _resume_if_free(self) -> None:
        """Resume once no pause, sleep or weight update holds the scheduler any more."""
        c = self.control
        if c.get("paused") is None and not c.get("sleeping_tags") and not c.get("weight_update_active"):
            self.sched.resume()
            self.sleep_paused = False

    def _quiesce(self, mode: str, clear_cache: bool) -> Any:
        aborted = self.sched.pause(mode, clear_cache)
        for seq in aborted:
            seq.finish_reason = "abort"
        self._emit([(seq, self._output(seq, [], finished=True)) for seq in aborted])
        # Ack only when no step runs on the workers any more (and, for wait, nothing is left to run):
        # whoever paused may now change the weights or free the memory under them.
        self.pause_pending = {"mode": mode, "clear_cache": clear_cache, "aborted": len(aborted)}
        self._maybe_complete_pause()
        return DEFER if self.pause_pending is not None else {"paused": True, "aborted": len(aborted)}

    def _maybe_complete_pause(self) -> None:
        p = self.pause_pending
        if p is None or self.in_flight is not None:
            return
        if not self.sched.complete_pause(p["clear_cache"]):
            return
        self.pause_pending = None
        if self.link.deferred is not None:
            self.link.complete({"paused": True, "aborted": p["aborted"]})

    def _fail_all(self, reason: str) -> None:
        """A worker is gone: nothing can be computed any more. Fail every request; refuse new ones."""
        log.error("scheduler.failing_all", reason=reason)
        if self.sched is None:
            return  # still starting: nothing to fail, and wait_for_workers waits for its replacement
        self.dead_reason = reason
        self.in_flight = None
        self._fail_seqs(list(self.sched.seqs.values()), reason)

    def _fail_seqs(self, seqs: list[Sequence], reason: str) -> None:
        outs = []
        for seq in seqs:
            if self.sched.abort(seq.seq_id) is None:
                continue
            seq.finish_reason = "error"
            outs.append((seq, self._output(seq, [], finished=True, error=reason)))
        self._emit(outs)


def run_scheduler_process(cfg: EngineConfig) -> None:
    setup_logging(cfg.log_level, process=NAME)
    ctx = zmq.Context()
    ep = Endpoints.from_config(cfg)
    actor = SchedulerActor(cfg, ep, ctx)
    try:
        actor.link.wait_welcome(timeout_s=120)
        info = actor.wait_for_workers()
        report_ready(ctx, ep.ready, "scheduler", NAME, info)
        actor.run()
    finally:
        actor.link.close()
        ctx.destroy(linger=500)
