"""A worker process: owns one device, the model's weights on it and its KV cache; executes the step
plans the scheduler publishes and pushes back the sampled tokens. Socket loop only; the compute is in
workers.model_runner.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import structlog
import torch
import zmq

from ascend_ops.batch_invariant import BatchInvarianceUnavailable, kernels, self_check
from ascend_ops.platform import current_platform
from bus.codec import CodecError, decode
from bus.endpoints import COMMAND_TOPIC, PLAN_TOPIC, Endpoints, presence_topic
from bus.member import MemberLink
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    AbortWeightUpdate,
    CollectiveRpc,
    Command,
    CommandBody,
    CommitWeightUpdate,
    ErrorInfo,
    FinishWeightUpdate,
    Health,
    Hello,
    InitWeightTransferEngine,
    Pause,
    ReleaseMemory,
    Shutdown,
    ShutdownWeightTransferEngine,
    Sleep,
    StartWeightUpdate,
    StepPlan,
    StepResult,
    UpdateWeights,
    UpdateWeightVersion,
    WakeUp,
    WeightChecker,
)
from bus.sockets import make_socket, recv, report_ready, send
from engine import control_state
from engine.config import EngineConfig
from engine.logs import setup_logging
from engine.rl_config import determinism, parse_additional_config, worker_env_updates
from engine.weight_transfer_config import parse_weight_transfer_config
from engine.weight_update import WeightSyncError
from workers.extension import call_extension, call_hook, extend_worker_class, extension_methods
from workers.kv_cache import KVCache, plan_num_blocks
from workers.loader import load_model, reload_weights
from workers.model_runner import ModelRunner
from workers.sleep import SleepManager
from workers.weight_receiver import WeightReceiver

log = structlog.get_logger()

class StepInterrupted(Exception):
    pass


class WorkerActor:
    def __init__(self, cfg: EngineConfig, rank: int, ctx: zmq.Context, ep: Endpoints):
        self.cfg, self.rank = cfg, rank
        self.name = f"worker-{rank}"
        platform = current_platform()
        device = platform.device(rank)
        extra = parse_additional_config(cfg.additional_config)
        det = determinism(extra)
        model, hf_config, max_model_len = load_model(cfg, device, kernels(det.batch_invariant))
        checked: list[str] = []
        if det.batch_invariant:  # measured here, on this device, with this model's shapes: never assumed
            try:
                checked = self_check(model, cfg.block_size)
            except BatchInvarianceUnavailable as e:
                raise SystemExit(f"rollbus: {det.source}: {e}") from None
        nl, nkv, hd = model.kv_spec
        dtype = next(model.parameters()).dtype
        per_block = KVCache.bytes_per_block(nl, nkv, hd, cfg.block_size, dtype)
        num_blocks = plan_num_blocks(platform, bytes_per_block=per_block,
                                     kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                                     num_blocks_override=cfg.num_gpu_blocks_override,
                                     gpu_memory_utilization=cfg.gpu_memory_utilization, device_index=rank)
        if num_blocks * cfg.block_size < max_model_len:
            raise SystemExit(
                f"KV cache of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_model_len}; raise --kv-cache-memory-bytes or lower --max-model-len")
        kv = KVCache(nl, nkv, hd, cfg.block_size, num_blocks, dtype, device)
        self.runner = ModelRunner(model, kv, rank=rank, block_size=cfg.block_size, device=device, seed=cfg.seed,
                                  logprobs_mode=cfg.logprobs_mode,
                                  return_routed_experts=cfg.enable_return_routed_experts)
        self.sleep = SleepManager(model, kv, platform)
        self.extra_cleanup = extra.rl.effective()["sleep_mode_extra_cleanup"]
        self.weights = WeightReceiver(model, parse_weight_transfer_config(cfg.weight_transfer_config), rank=rank,
                                      device=device, nz_mode=extra.weight_nz_mode)
        self.info = {"num_blocks": num_blocks, "max_model_len": max_model_len, "device": str(device),
                     "dtype": str(dtype).removeprefix("torch."), "kv_cache_bytes": kv.nbytes,
                     "kernels": model.kern.name, "batch_invariant_checked": checked,
                     "worker_extension_methods": extension_methods(self)}
        log.info("worker.loaded", **self.info)
        self.plans = make_socket(ctx, zmq.SUB, connect=ep.plans)
        self.plans.setsockopt(zmq.SUBSCRIBE, PLAN_TOPIC)
        self.plans.setsockopt(zmq.SUBSCRIBE, presence_topic(self.name))
        self.results = make_socket(ctx, zmq.PUSH, connect=ep.results)
        w = self.weights
        self.link = MemberLink(ctx, ep, role="worker", name=self.name, info=self.info, handlers={
            Health: lambda c: {"ok": True},
            Shutdown: self._shutdown,
            ReleaseMemory: self._reporting(self._release_memory),
            WakeUp: self._reporting(self._wake_up),
            UpdateWeightVersion: self._new_epoch,
            InitWeightTransferEngine: lambda c: w.init(c.init_info),
            StartWeightUpdate: lambda c: w.start(weights_asleep="weights" in self.sleep.asleep),
            UpdateWeights: self._update_weights,
            FinishWeightUpdate: lambda c: w.finish(),
            CommitWeightUpdate: self._reporting(self._commit),
            AbortWeightUpdate: lambda c: w.abort(),
            ShutdownWeightTransferEngine: lambda c: w.shutdown(),
            WeightChecker: self._weight_checker,
            CollectiveRpc: self._reporting(self._rpc),
        }, heartbeat_interval_s=cfg.heartbeat_interval_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.stopping = False
        self.abort_watch = _AbortWatcher(ctx, ep.commands, self.name)

    def start(self) -> None:
        state = self.link.wait_welcome(timeout_s=120)
        self.runner.weight_version = state.weight_epoch
        if "weights" in state.sleeping_tags:  # joined a sleeping engine: sleep as well
            self.sleep.sleep(state.sleep_level or 1)
        send(self.results, Hello("worker", self.name, os.getpid(), PROTOCOL_VERSION, self.info, PROTOCOL_FINGERPRINT))

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.plans, *self.link.sockets):
            poller.register(s, zmq.POLLIN)
        idle_ms = self.cfg.heartbeat_interval_s * 1000 / 2
        while not self.stopping:
            ready = [sock for sock, _ in poller.poll(idle_ms)]
            # Commands first: a step can take seconds, and an ack (say, of a resume that arrived with the
            # step it unblocked) must not wait behind it.
            for sock in ready:
                if sock is not self.plans:
                    self.link.handle(sock)
            if self.plans in ready and not self.stopping:
                self._on_plan()
            self.link.tick(time.monotonic())

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
            self._await_wake()
        if plan.seq_ids and self.sleep.missing:  # never compute with weights a level-2 sleep discarded
            st = self.sleep.weights_status()
            why = control_state.weights_discarded_message(st["weights_missing"], st["weights_total"])
            send(self.results, self._no_result(plan, ErrorInfo("WeightsDiscarded", why, self.name, 503)))
            return
        try:
            result = self.runner.execute(plan, self._check_interrupt)
        except StepInterrupted:
            result = self._no_result(plan)
            result.interrupted = True
        except Exception as e:  # report, so the scheduler fails the step's requests instead of hanging
            log.exception("worker.step_failed", step=plan.step_id)
            result = self._no_result(plan, ErrorInfo(type(e).__name__, str(e), self.name))
        if plan.seq_ids:
            send(self.results, result)

    def _no_result(self, plan: StepPlan, error: ErrorInfo | None = None) -> StepResult:
        """A step that sampled nothing: failed (error) or interrupted (the caller sets it)."""
        return StepResult(plan.step_id, self.rank, [], None, None, None, None, self.runner.weight_version, error)

    def _check_interrupt(self) -> None:
        """Between layers: an abort pause (or abort sleep) that the loop has not applied yet ends the
        step now instead of after it, so /pause?mode=abort returns in milliseconds even while a long
        step runs. Only aborting commands interrupt (their requests are dropped anyway). A plain int
        compare: touching a zmq socket here slowed every step's neighbours on a busy 2-core host."""
        if self.abort_watch.abort_seq > (self.link.follower.seq or 0):
            raise StepInterrupted()

    # --- control (handlers of the typed commands; the follower has applied the state already) ------

    def _reporting(self, handler):
        """Acks of the commands that can change it carry how many parameters lack content (sleep level 2):
        the coordinator turns a change into a WeightsMissing broadcast."""
        def handle(cmd: CommandBody) -> dict[str, Any]:
            return {**(handler(cmd) or {}), **self.sleep.weights_status()}
        return handle

    def _shutdown(self, cmd: Shutdown) -> None:
        self.stopping = True

    def _release_memory(self, cmd: ReleaseMemory) -> dict[str, Any]:
        """Second phase of /sleep: the scheduler has quiesced."""
        level = cmd.level
        released = self.sleep.sleep(level) + (self.weights.release() if level >= 1 else 0)
        group = level >= 1 and self.extra_cleanup and self.weights.release_group()
        log.info("worker.sleep", level=level, released_bytes=released, released_group=group)
        return {"released_bytes": released, "released_group": group}

    def _wake_up(self, cmd: WakeUp) -> dict[str, Any]:
        tags = [t for t in (cmd.tags or ["weights", "kv_cache"]) if t != "scheduling"]
        restored = self.sleep.wake(tags) if tags else 0
        log.info("worker.wake_up", tags=tags, restored_bytes=restored)
        return {"restored_bytes": restored}

    def _new_epoch(self, cmd: UpdateWeightVersion) -> None:
        self.runner.weight_version = self.link.state.weight_epoch

    def _update_weights(self, cmd: UpdateWeights) -> dict[str, Any] | None:
        """The weight-transfer lifecycle (workers.weight_receiver); errors carry their HTTP status."""
        info = cmd.update_info
        if isinstance(info, list):  # v0.33: one entry per global worker rank
            if self.rank >= len(info):
                raise WeightSyncError(f"update_info has {len(info)} entries; worker rank {self.rank} has none",
                                      param="update_info")
            info = info[self.rank]
        return self.weights.update(info)

    def _commit(self, cmd: CommitWeightUpdate) -> dict[str, Any] | None:
        out = self.weights.commit()
        if out.get("committed"):
            self.sleep.mark_loaded(self.weights.received)
        self.runner.weight_version = self.link.state.weight_epoch
        return out

    def _weight_checker(self, cmd: WeightChecker) -> dict[str, Any]:
        if "weights" in self.sleep.asleep:
            raise WeightSyncError("the weights are asleep: /wake_up?tags=weights first", status=409)
        return {"checksums": self.weights.checksums(f"dp{self.rank}:pp0:pcp0:tp0:")}

    def _rpc(self, cmd: CollectiveRpc) -> dict[str, Any]:
        """The allow-listed worker methods reachable through POST /collective_rpc."""
        method, args, kwargs = cmd.method, cmd.args, cmd.kwargs
        if method in self.info["worker_extension_methods"]:  # --worker-extension-cls (workers.extension)
            return {"extension_result": call_extension(self, method, args, kwargs)}
        if method != "reload_weights":
            raise ValueError(f"method {method!r} is not callable through collective_rpc")
        if "weights" in self.sleep.asleep:
            raise RuntimeError("the weights are asleep: wake_up?tags=weights first")
        names = reload_weights(self.runner.model, self.cfg, kwargs.get("weights_path"))
        self.sleep.mark_loaded(names)
        return {"loaded_tensors": len(names)}


def run_worker_process(cfg: EngineConfig, rank: int = 0) -> None:
    setup_logging(cfg.log_level, process=f"worker-{rank}")
    # RL mode: allocator and NZ settings must change before the first device allocation.
    extra = parse_additional_config(cfg.additional_config)
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
    actor = extend_worker_class(WorkerActor, cfg.worker_extension_cls)(cfg, rank, ctx, ep)
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
