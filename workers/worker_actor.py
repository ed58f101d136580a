"""A worker process: owns one device, the model's weights on it and its KV cache; executes the step
plans the scheduler publishes and pushes back the sampled tokens. Socket loop only; the compute is in
workers.model_runner.

Recovery: a worker starts from the checkpoint; when the engine had committed weight updates before it
(re)started (ControlState.weight_commits), it loads its recovery copy of that update
(--weights-recovery-dir, engine.weights.recovery) or, lacking one, says the version is lost (WeightsLost:
requests 503 until an update commits) and computes nothing meanwhile; it never serves another version.
It (re)introduces itself to the scheduler (Hello on the results socket, with the seq it joined at) when
it joins and whenever a scheduler joins; a stall that got it declared lost drops the sequences it held.

Tensor parallelism (-tp N): this worker is tp rank `rank` of its engine, holds that shard of the model
and joins the engine's tp group (ascend_ops.tp_group) before loading. Every plan's forward is collective,
so before computing the ranks agree (one flag) that all of them can run it: a rank that cannot (weights
lost, unknown sequences) answers with its error, the others with a TensorParallelPeer error, and nobody
computes. An abort pause seen between layers by any rank ends the step on every rank. A step that raises
mid-way, a failed collective, or a tp peer lost leaves the group out of step: the worker reports and exits
(the launcher restarts the engine's workers, which form a new group).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, Union

import msgspec
import structlog
import torch
import zmq

from ascend_ops import packed_linear
from ascend_ops.platform import current_platform
from ascend_ops.tp_group import TPError, init_tp_group
from bus import control_state
from bus.codec import CodecError, decode
from bus.endpoints import COMMAND_TOPIC, PLAN_TOPIC, Endpoints, presence_topic
from bus.member import MemberLink
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    AbortWeightUpdate,
    Checksums,
    CollectiveRpc,
    Command,
    CommandBody,
    CommitWeightUpdate,
    ControlReply,
    ErrorInfo,
    ErrorKind,
    ExtensionCall,
    ExtensionReturned,
    FinishWeightUpdate,
    Health,
    HealthReport,
    Hello,
    InitWeightTransferEngine,
    LoraTargetCall,
    MemberJoined,
    MemberLost,
    MemoryReleased,
    Pause,
    ReleaseMemory,
    ShareWeights,
    Shutdown,
    ShutdownWeightTransferEngine,
    Sleep,
    StartWeightUpdate,
    StepPlan,
    StepResult,
    TransferShutDown,
    UpdateCommitted,
    UpdateStarted,
    UpdateWeights,
    UpdateWeightVersion,
    WakeUp,
    WeightChecker,
    WeightsReceived,
    WeightsReloaded,
    WeightsZeroed,
    WokeUp,
)
from bus.sockets import make_socket, recv, report_ready, send
from bus.topology import Topology
from engine.config import EngineConfig
from engine.fleet.catch_up import catch_up_config
from engine.logs import setup_logging
from engine.rl_config import determinism, worker_env_updates
from engine.weights.protocol import WeightSyncError
from engine.weights.receiver import WeightReceiver
from engine.weights.recovery import WeightRecovery
from workers.extension import call_extension, call_hook, extend_worker_class, extension_methods
from workers.loader import reload_weights
from workers.lora_stage import LoraStage
from workers.sleep import SleepManager
from workers.startup import load_worker

# the acks that carry the worker's weights status (WorkerActor._reporting)
Reporting = Union[MemoryReleased, WokeUp, UpdateCommitted, WeightsReloaded, ExtensionReturned, Checksums, WeightsZeroed]

log = structlog.get_logger()

# Commands that never write parameters; after any other the CPU packed weights are dropped (_repacking).
WEIGHTS_UNTOUCHED = frozenset({Health, Shutdown, UpdateWeightVersion, InitWeightTransferEngine,
                               ShutdownWeightTransferEngine, WeightChecker, MemberLost, MemberJoined, ShareWeights})
TP_ABORT_EVERY = 4  # tp: layers between the (collective) checks for an abort pause


class StepInterrupted(Exception):
    pass


class WorkerActor:
    def __init__(self, cfg: EngineConfig, rank: int, ctx: zmq.Context, ep: Endpoints, device_index: int | None = None):
        self.cfg, self.rank = cfg, rank  # rank: the tensor-parallel rank inside our engine
        # data parallelism (bus.topology): our engine, global worker index, name, and whose weights we can
        # take after a restart (the same tp rank in another engine)
        topo = Topology.from_config(cfg)
        self.engine = cfg.parallel.data_parallel_rank
        self.index = topo.worker_index(self.engine, rank)
        self.name = topo.worker_name(self.engine, rank)
        self.scheduler_name = topo.scheduler_name(self.engine)
        self.donor = topo.donor(self.engine, rank)
        tp, dp_rank = topo.tp, self.engine
        platform = current_platform()
        device_index = topo.local_device(self.engine, rank) if device_index is None else device_index
        device = platform.device(device_index)
        self.layers_done = 0  # layers of the step in progress (tp: when to check for an abort together)
        extra = cfg.rl.additional_config
        det = determinism(extra)
        try:
            self.tp = init_tp_group(rank, tp, device, addr=cfg.parallel.master_addr,
                                    port=cfg.parallel.master_port + dp_rank,
                                    timeout_s=cfg.parallel.distributed_timeout_seconds)
        except TPError as e:
            raise SystemExit(f"rollbus: {self.name}: {e}") from None
        self.tp_peers = set(topo.worker_names(self.engine)) - {self.name}
        self.fatal: str | None = None  # the tp group is out of step: exit (the launcher restarts us)
        loaded = load_worker(cfg, name=self.name, rank=rank, tp_size=tp, device=device,
                             device_index=device_index, platform=platform, det=det, tp=self.tp)
        model, kv, self.runner = loaded.model, loaded.kv, loaded.runner
        self.sleep = SleepManager(model, kv, platform)
        self.extra_cleanup = extra.rl.effective()["sleep_mode_extra_cleanup"]
        self.weights = WeightReceiver(model, cfg.rl.weight_transfer_config, rank=self.index,
                                      device=device, nz_mode=extra.weight_nz_mode)
        self.info = msgspec.structs.replace(loaded.info, worker_extension_methods=extension_methods(self))
        log.info("worker.loaded", **msgspec.structs.asdict(self.info))
        self.plans = make_socket(ctx, zmq.SUB, connect=ep.plans)
        self.plans.setsockopt(zmq.SUBSCRIBE, PLAN_TOPIC)
        self.plans.setsockopt(zmq.SUBSCRIBE, presence_topic(self.name))
        self.results = make_socket(ctx, zmq.PUSH, connect=ep.results)
        w = self.weights
        self.runner.grammar.wait_ready()
        self.link = MemberLink(ctx, ep, role="worker", name=self.name, info=self.info, handlers=self._repacking({
            Health: lambda c: HealthReport(True),
            Shutdown: self._shutdown,
            ReleaseMemory: self._reporting(self._release_memory),
            WakeUp: self._reporting(self._wake_up),
            UpdateWeightVersion: self._new_epoch,
            InitWeightTransferEngine: lambda c: w.init(c.init_info),
            StartWeightUpdate: self._start_update,
            UpdateWeights: self._update_weights,
            FinishWeightUpdate: lambda c: w.finish(),
            CommitWeightUpdate: self._reporting(self._commit),
            AbortWeightUpdate: lambda c: w.abort(),
            ShutdownWeightTransferEngine: self._shutdown_transfer,
            WeightChecker: self._reporting(self._weight_checker),
            CollectiveRpc: self._reporting(self._rpc),
            MemberLost: self._member_lost,
            MemberJoined: self._member_joined,
            ShareWeights: lambda c: self.recovery.share(c, self.away),
        }), heartbeat_interval_s=cfg.bus.heartbeat_interval_s, heartbeat_timeout_s=cfg.bus.heartbeat_timeout_s)
        self.stopping = False
        self.abort_watch = _AbortWatcher(ctx, ep.commands, self.name)
        self.away = False  # declared lost (a stall) and not welcomed back yet: updates then run without us
        self.recovery = WeightRecovery(model, folder=cfg.rl.weights_recovery_dir, index=self.index, name=self.name,
                                       donor=self.donor, link=self.link, sleep=self.sleep,
                                       control_timeout_s=cfg.bus.control_timeout_s, fleet=catch_up_config(cfg))
        self.link.on_reply = self._on_reply

    def start(self) -> None:
        state = self.link.wait_welcome(timeout_s=120)
        self.runner.weight_epoch = state.weight_epoch
        self.recovery.restore()
        if "weights" in state.sleeping_tags:  # joined a sleeping engine: sleep as well
            self.sleep.sleep(state.sleep_level or 1)
        self._hello_scheduler(self.link.follower.seq or 0)

    def _hello_scheduler(self, joined_seq: int) -> None:
        """Introduce ourselves on the results socket: the scheduler waits for this (joined at or after our
        last loss) before it plans for us again. Not while a peer's copy of the weights is on its way."""
        if self.recovery.restoring is not None:
            return
        info = msgspec.structs.replace(self.info, joined_seq=joined_seq)
        send(self.results, Hello("worker", self.name, os.getpid(), PROTOCOL_VERSION, info, PROTOCOL_FINGERPRINT))

    def _on_reply(self, reply: ControlReply) -> None:
        if self.recovery.on_reply(reply):  # a peer's copy of the weights arrived (or did not)
            self._hello_scheduler(self.link.follower.seq or 0)

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.plans, *self.link.sockets):
            poller.register(s, zmq.POLLIN)
        idle_ms = self.cfg.bus.heartbeat_interval_s * 1000 / 2
        while not self.stopping:
            if self.fatal:
                raise SystemExit(f"rollbus: {self.name}: {self.fatal}")
            ready = [sock for sock, _ in poller.poll(idle_ms)]
            # Commands first: a step can take seconds, and an ack (say, of a resume that arrived with the
            # step it unblocked) must not wait behind it.
            for sock in ready:
                if sock is not self.plans:
                    self.link.handle(sock)
            if self.plans in ready and not self.stopping:
                self._on_plan()
            self.link.tick(time.monotonic())
            if self.recovery.poll():  # a fleet peer's copy of the weights arrived (or did not)
                self._hello_scheduler(self.link.follower.seq or 0)

    def _on_plan(self) -> None:
        try:
            plan = recv(self.plans, topic=True)
        except CodecError as e:
            log.warning("worker.bad_plan", error=str(e))
            return
        if not isinstance(plan, StepPlan):
            log.warning("worker.bad_plan", error=f"a {type(plan).__name__} where a StepPlan goes")
            return
        if self.sleep.asleep and plan.seq_ids:
            self._await_wake(plan.step_id)
        refusal = self._refusal(plan) if plan.seq_ids else None
        if self.tp.size > 1 and plan.seq_ids:
            try:
                blocked = self.tp.any(refusal is not None)
            except TPError as e:
                self._tp_failed(plan, e)
                return
            if blocked and refusal is None:
                refusal = ErrorInfo(ErrorKind.TP_PEER, "another tensor-parallel worker of this engine could not run "
                                    f"step {plan.step_id}", self.name)
        if refusal is not None:
            self.runner.drop(plan.seq_ids)  # the scheduler fails them: a plan sent after this one may name them
            send(self.results, self._no_result(plan, refusal))
            return
        self.layers_done = 0
        try:
            result = self.runner.execute(plan, self._check_interrupt)
        except StepInterrupted:
            self.runner.drop(plan.seq_ids)  # aborted: a plan sent after this one may still name them
            result = self._no_result(plan)
            result.interrupted = True
        except Exception as e:  # report, so the scheduler fails the step's requests instead of hanging
            if self.tp.size > 1:  # the other ranks may be inside a collective this one left
                self._tp_failed(plan, e)
                return
            log.exception("worker.step_failed", step=plan.step_id)
            self.runner.drop(plan.seq_ids)  # failed: their state here is behind the plans that follow
            result = self._no_result(plan, ErrorInfo(type(e).__name__, str(e), self.name))
        if plan.seq_ids:
            send(self.results, result)

    def _await_wake(self, step_id: int, timeout_s: float = 10.0) -> None:
        """A plan can overtake the wake_up command sent before it (they travel on different sockets): handle
        the pending commands first, so the step never runs on released memory (`_refusal` answers a plan
        that still finds this worker asleep)."""
        log.info("worker.plan_before_wake", step=step_id, asleep=sorted(self.sleep.asleep))
        poller = zmq.Poller()
        for s in self.link.sockets:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while self.sleep.asleep and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                self.link.handle(sock)

    def _refusal(self, plan: StepPlan) -> ErrorInfo | None:
        """Why this worker must not compute `plan` (None: it can)."""
        if self.sleep.asleep:  # never compute on released memory
            return ErrorInfo(ErrorKind.ASLEEP, f"{self.name} got step {plan.step_id} while its "
                             f"{', '.join(sorted(self.sleep.asleep))} sleep: /wake_up first", self.name, 503)
        if self.recovery.weights_lost is not None:  # never compute with a version not in service
            why = (control_state.weights_lost_message(self.link.state)
                   or f"weight version {self.recovery.weights_lost!r} lost")
            return ErrorInfo(ErrorKind.WEIGHT_VERSION_LOST, why, self.name, 503)
        if self.sleep.missing:  # never compute with weights a level-2 sleep discarded
            st = self.sleep.weights_status()
            why = control_state.weights_discarded_message(st.missing, st.total, self.link.state.weight_version)
            return ErrorInfo(ErrorKind.WEIGHTS_DISCARDED, why, self.name, 503)
        known = self.runner.seqs.keys() | self.runner.dropped | {ns.seq_id for ns in plan.new_seqs}
        unknown = [sid for sid in plan.seq_ids if sid not in known]
        if unknown:  # planned before a stall or a scheduler's return made us forget them: nothing to compute
            log.warning("worker.stale_plan", step=plan.step_id, unknown=len(unknown))
            return ErrorInfo(ErrorKind.UNKNOWN_SEQUENCE,
                             f"{len(unknown)} sequences of step {plan.step_id} are unknown here", self.name)
        return None

    def _tp_failed(self, plan: StepPlan, e: BaseException) -> None:
        """A tp step failed part-way (or a collective did): report it, then leave, so the engine's workers
        form a new group instead of running collectives out of step."""
        log.error("worker.tp_step_failed", step=plan.step_id, error=f"{type(e).__name__}: {e}", exc_info=e)
        send(self.results, self._no_result(plan, ErrorInfo(type(e).__name__, str(e), self.name)))
        self.fatal = f"tensor-parallel step {plan.step_id} failed ({type(e).__name__}: {e}); restarting"


    def _no_result(self, plan: StepPlan, error: ErrorInfo | None = None) -> StepResult:
        """A step that sampled nothing: failed (error) or interrupted (the caller sets it)."""
        return StepResult(plan.step_id, self.rank, [], None, None, None, None, self.runner.weight_epoch, error)

    def _check_interrupt(self) -> None:
        """Between layers: an abort pause (or abort sleep) that the loop has not applied yet ends the
        step now instead of after it, so /pause?mode=abort returns in milliseconds even while a long
        step runs. Only aborting commands interrupt (their requests are dropped anyway). A plain int
        compare: touching a zmq socket here slowed every step's neighbours on a busy 2-core host."""
        abort = self.abort_watch.abort_seq > (self.link.follower.seq or 0)
        if self.tp.size > 1:  # every rank ends the step at the same layer, or none does
            self.layers_done += 1
            if self.layers_done % TP_ABORT_EVERY:
                return
            abort = self.tp.any(abort)
        if abort:
            raise StepInterrupted()

    # --- control (handlers of the typed commands; the follower has applied the state already) ------

    def _repacking(self, handlers: dict) -> dict:
        """Every command that may change weights in place drops the CPU packed copies afterwards
        (ascend_ops.packed_linear), so the next step packs what is in the parameters then; a failed
        handler drops them too, it may have written part of an update. (An update whose target is a LoRA
        adapter writes no weight of the model, but keeping the packed copies then made bench/lora_reload.py's
        pushes slower, 20 ms more server CPU at the median: not understood yet, so they go as for any update.)"""
        def wrap(handler):
            def handle(cmd: CommandBody) -> Any:
                try:
                    return handler(cmd)
                finally:
                    packed_linear.forget(self.runner.model)
            return handle
        return {t: h if t in WEIGHTS_UNTOUCHED else wrap(h) for t, h in handlers.items()}

    def _reporting(self, handler: Callable[[CommandBody], Reporting]) -> Callable[[CommandBody], Reporting]:
        """Acks of the commands that can change it carry how many parameters lack content (sleep level 2):
        the coordinator turns a change into a WeightsMissing broadcast."""
        def handle(cmd: CommandBody) -> Reporting:
            result = handler(cmd)
            result.weights = self.sleep.weights_status()
            return result
        return handle

    def _shutdown(self, cmd: Shutdown) -> None:
        self.stopping = True

    def _member_lost(self, cmd: MemberLost) -> None:
        if cmd.name in self.tp_peers:  # our tp group lost a rank: its collectives can never complete again
            self.fatal = f"tensor-parallel peer {cmd.name} was lost ({cmd.why}); restarting to form a new group"
            return
        if cmd.name == self.name:  # we stalled past the heartbeat timeout: the scheduler failed our sequences
            log.warning("worker.was_lost", why=cmd.why, dropped=len(self.runner.seqs))
            self.runner.seqs.clear()
            self.away = True

    def _member_joined(self, cmd: MemberJoined) -> None:
        if cmd.name == self.scheduler_name:  # a new (or returning) scheduler knows none of our sequences
            self.runner.seqs.clear()
        elif cmd.name == self.name:  # (back) in: after a stall an update may have committed without us
            self.away = False
            self.recovery.restore()
        else:
            return
        self._hello_scheduler(self.link.follower.current.seq)

    def _release_memory(self, cmd: ReleaseMemory) -> MemoryReleased:
        """Second phase of /sleep: the scheduler has quiesced."""
        level = cmd.level
        blocks = cmd.kv_blocks.get(self.scheduler_name, []) if cmd.offload_kv else None
        released = self.sleep.sleep(level, blocks) + (self.weights.release() if level >= 1 else 0)
        group = level >= 1 and self.extra_cleanup and self.weights.release_group()
        dropped: list[str] = []
        if level == 2 and self.runner.lora is not None:  # adapters go with the base weights (vLLM's level 2)
            freed, dropped = self.runner.lora.sleep_drop()
            released += freed
        log.info("worker.sleep", level=level, released_bytes=released, released_group=group, lora_dropped=dropped)
        return MemoryReleased(released, bool(group), lora_dropped=dropped)

    def _wake_up(self, cmd: WakeUp) -> WokeUp:
        tags = [t for t in (cmd.tags or ["weights", "kv_cache"]) if t != "scheduling"]
        restored = self.sleep.wake(tags) if tags else 0
        log.info("worker.wake_up", tags=tags, restored_bytes=restored)
        return WokeUp(restored)

    def _new_epoch(self, cmd: UpdateWeightVersion) -> None:
        self.runner.weight_epoch = self.link.state.weight_epoch

    def _start_update(self, cmd: StartWeightUpdate) -> UpdateStarted:
        self.recovery.update_started_away = self.away
        self.weights.start(weights_asleep="weights" in self.sleep.asleep)
        return UpdateStarted()

    def _update_weights(self, cmd: UpdateWeights) -> WeightsReceived:
        """The weight-transfer lifecycle (engine.weights.receiver); errors carry their HTTP status."""
        info = cmd.update_info
        if isinstance(info, list):  # v0.33: one entry per global worker rank
            if self.index >= len(info):
                raise WeightSyncError(f"update_info has {len(info)} entries; worker rank {self.index} has none",
                                      param="update_info")
            info = info[self.index]
        return self.weights.update(info)

    def _commit(self, cmd: CommitWeightUpdate) -> UpdateCommitted:
        received = list(self.weights.received)
        lora = self.weights.lora is not None  # an adapter's tensors: the model's weights did not change
        out = self.weights.commit()
        if out.committed and not lora:
            self.sleep.mark_loaded(received)
        self.runner.weight_epoch = self.link.state.weight_epoch
        # an adapter's commit counts as the engine's commit too (the base weights held stay held)
        self.recovery.committed(out.committed, [] if lora else received, self.away)
        return out

    def _lora_target(self, call: LoraTargetCall) -> bool | None:
        slots = self.runner.lora
        if slots is None:
            raise WeightSyncError("Received a LoRA weight update but this engine was started without --enable-lora",
                                  param="method")
        if not call.version:
            return slots.discard_memory(call.lora_id)
        self.weights.arm_lora(LoraStage(call, slots.hf_config, slots))
        return None

    def _shutdown_transfer(self, cmd: ShutdownWeightTransferEngine) -> TransferShutDown:
        self.weights.shutdown()
        return TransferShutDown()

    def _weight_checker(self, cmd: WeightChecker) -> Checksums | WeightsZeroed:
        if "weights" in self.sleep.asleep:
            raise WeightSyncError("the weights are asleep: /wake_up?tags=weights first", status=409)
        if cmd.action == "reset":  # vLLM's: zero every weight (nothing is served until a full update)
            return WeightsZeroed(self.sleep.zero_weights())
        listed, stacked = self.weights.checksums(f"dp{self.engine}:pp0:pcp0:tp{self.rank}:")
        return Checksums(listed, stacked=stacked)

    def _rpc(self, cmd: CollectiveRpc) -> WeightsReloaded | ExtensionReturned:
        """The allow-listed worker methods reachable through POST /collective_rpc."""
        method, call = cmd.method, cmd.call
        if isinstance(call, ExtensionCall):  # --worker-extension-cls (workers.extension)
            if method not in self.info.worker_extension_methods:
                raise ValueError(f"method {method!r} is not a method of --worker-extension-cls")
            args, kwargs = msgspec.json.decode(call.args_json), msgspec.json.decode(call.kwargs_json)
            return ExtensionReturned(call_extension(self, method, args, kwargs))
        if isinstance(call, LoraTargetCall):  # SkyRL's in-memory LoRA (workers/lora_stage.py)
            return ExtensionReturned(self._lora_target(call))
        if method != "reload_weights":
            raise ValueError(f"method {method!r} is not callable through collective_rpc")
        if "weights" in self.sleep.asleep:
            raise RuntimeError("the weights are asleep: wake_up?tags=weights first")
        names = reload_weights(self.runner.model, self.cfg, call.weights_path)
        self.sleep.mark_loaded(names)
        self.recovery.keep()  # a restart must come back with these weights, not the update's
        return WeightsReloaded(len(names))


def run_worker_process(cfg: EngineConfig, rank: int = 0, device_index: int | None = None) -> None:
    setup_logging(cfg.log_level, process=Topology.from_config(cfg).worker_name(cfg.parallel.data_parallel_rank, rank))
    # RL mode: allocator and NZ settings must change before the first device allocation.
    extra = cfg.rl.additional_config
    for var, value in worker_env_updates(extra, dict(os.environ)).items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
        log.info("worker.rl_env", var=var, value=value)
    if determinism(extra).batch_invariant:  # any op without a deterministic implementation raises
        torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    ctx = zmq.Context()
    ep = Endpoints.from_config(cfg).secure(ctx)
    actor = extend_worker_class(WorkerActor, cfg.parallel.worker_extension_cls)(cfg, rank, ctx, ep, device_index)
    call_hook(actor, "init_worker_extension")
    try:
        actor.start()
        report_ready(ctx, ep.ready, "worker", actor.name, actor.info)
        actor.run()
    finally:
        call_hook(actor, "destroy_worker_extension")
        actor.abort_watch.stop()
        actor.link.close()
        ctx.destroy(linger=500)


class _AbortWatcher:
    """Watches the command broadcast from a thread of its own (its own SUB socket) and records the
    latest seq of an aborting pause or sleep, for the compute loop to compare against."""

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str):
        self.abort_seq = 0
        self._stop = threading.Event()
        self._args = (ctx, endpoint)
        threading.Thread(target=self._run, name=f"{name}-abort-watch", daemon=True).start()

    def _run(self) -> None:
        ctx, endpoint = self._args
        try:
            sub = make_socket(ctx, zmq.SUB, connect=endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, COMMAND_TOPIC)
            while not self._stop.is_set():
                if not sub.poll(500):
                    continue
                self._on_message(sub.recv_multipart())
            sub.close(0)
        except zmq.ZMQError:
            pass  # context torn down at exit

    def _on_message(self, frames: list[bytes]) -> None:
        """Anything but a Command is dropped; a bad one is logged (the member's own SUB logs it too) and
        never ends this thread, or aborts would stop interrupting steps."""
        try:
            msg = decode(frames[1:])
        except CodecError as e:
            log.warning("worker.abort_watch_bad_message", error=str(e))
            return
        if isinstance(msg, Command) and isinstance(msg.body, (Pause, Sleep)) and msg.body.mode == "abort":
            self.abort_seq = max(self.abort_seq, msg.seq)

    def stop(self) -> None:
        self._stop.set()
