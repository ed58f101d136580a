"""The largest frame each bound bus socket accepts (ZeroMQ's ZMQ_MAXMSGSIZE): a bigger one is dropped by
libzmq before any of it is handed to the process, and the peer that sent it is disconnected (zmq reconnects
it). Every limit is above anything the engine's own processes send on that socket for the configuration
they run with, so it only stops a broken or hostile peer from making a process buffer gigabytes:

- requests (scheduler ROUTER; AddRequest, AbortRequests from gateways): 16 MiB + --max-request-body-bytes
  + 9 bytes x --max-prompt-tokens-per-request;
- results (scheduler PULL; Hello, StepResult arrays): 64 MiB + 8 bytes x (--max-logprobs + 1) x the most
  rows one array can have (max_model_len prompt positions, 1M when the model decides it); none with
  --max-logprobs -1, --enable-return-routed-experts or --return-sampling-mask (the whole vocabulary, every
  layer's experts, up to half the vocabulary per sampled row);
- control (coordinator ROUTER; Hello, Heartbeat, Ack with RPC results and checksums, ControlRequest with
  update metadata and RPC arguments): 128 MiB, or twice --max-request-body-bytes if that is more;
- plans, commands (XPUBs; subscriptions only): 64 KiB.

Weight tensors never travel on these sockets (shared memory / IPC handles or the trainer's own process
group carry them; docs/weight-sync.md). The launcher's ready socket lives in a private temporary folder.

`limits_for(cfg)` is the pure table; `attach(ctx, {address: limit})` gives a process's context its limits
(bus.endpoints.Endpoints.secure does it) and `bus.sockets.make_socket` applies them to what it binds, with
a monitor that logs each disconnected peer (`bus.peer_disconnected`: it exited, or sent a frame over the
limit; libzmq does not say which).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

log = structlog.get_logger()

MIB = 1 << 20
SUBSCRIPTIONS = 64 << 10
_LIMITS: weakref.WeakKeyDictionary[zmq.Context, dict[str, int]] = weakref.WeakKeyDictionary()


def limits_for(cfg: Any) -> dict[str, int]:
    """Endpoint name -> largest frame in bytes (-1: no limit), from an engine.config.EngineConfig (read by
    attribute: bus/ imports nothing above it)."""
    body = cfg.gateway.max_request_body_bytes
    prompt_tokens = cfg.gateway.max_prompt_tokens_per_request
    max_logprobs = cfg.model.max_logprobs
    if max_logprobs < 0 or cfg.rl.enable_return_routed_experts or cfg.rl.return_sampling_mask:
        results = -1
    else:
        # prompt logprobs: one row per prompt token (max_model_len, or 1M when it comes from the model)
        rows = max(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs, cfg.model.max_model_len or MIB)
        results = 64 * MIB + 8 * (max_logprobs + 1) * rows
    return {"requests": 16 * MIB + body + 9 * prompt_tokens, "results": results,
            "control": max(128 * MIB, 2 * body), "plans": SUBSCRIPTIONS, "commands": SUBSCRIPTIONS}


def attach(ctx: zmq.Context, by_address: dict[str, int]) -> None:
    """Sockets bound in ctx to one of these addresses get its limit."""
    _LIMITS.setdefault(ctx, {}).update(by_address)


def apply(ctx: zmq.Context, sock: zmq.Socket, address: str) -> None:
    """Before bind: the address's limit, and a monitor thread that logs disconnected peers."""
    limit = _LIMITS.get(ctx, {}).get(address, -1)
    if limit < 0:
        return
    sock.setsockopt(zmq.MAXMSGSIZE, limit)
    inproc = f"inproc://rollbus-monitor-{id(sock):x}"
    sock.monitor(inproc, zmq.EVENT_DISCONNECTED)
    threading.Thread(target=_watch, args=(ctx, inproc, address, limit), daemon=True,
                     name=f"monitor-{address.rsplit('/', 1)[-1]}").start()


def _watch(ctx: zmq.Context, inproc: str, address: str, limit: int) -> None:
    # zmq.Socket(ctx, ...) rather than ctx.socket(): ctx.destroy() must not close it under this thread; it
    # ends here, when the monitored socket closes (MONITOR_STOPPED) or the context terminates (ETERM).
    pair = zmq.Socket(ctx, zmq.PAIR)
    try:
        pair.connect(inproc)
        while True:
            event = recv_monitor_message(pair)
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            log.info("bus.peer_disconnected", socket=address, max_frame_bytes=limit,
                     detail="a peer of this bound socket went away: it exited, or it sent a frame above the "
                            "limit, which was dropped unread")
    except zmq.ZMQError:
        return
    finally:
        pair.close(linger=0)
