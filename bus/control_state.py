"""The engine's control state (bus.messages.ControlState: what the coordinator snapshots for late
joiners), and how each stateful command changes it. Pure.

The reducers are applied in one place per process: the coordinator's ledger (bus.control) when it
numbers a command, and every member's follower (bus.follower) before the member's handler runs, so
the scheduler, the workers and the gateway all hold the same state at the same seq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from bus.messages import (
    AbortWeightUpdate,
    CommandBody,
    CommitWeightUpdate,
    ControlState,
    LostMember,
    MemberJoined,
    MemberLost,
    Pause,
    PauseState,
    Resume,
    Sleep,
    StartWeightUpdate,
    UpdateWeightVersion,
    WakeUp,
    WeightsLost,
    WeightsMissing,
)

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."


ENGINE_ROLES = ("scheduler", "worker")  # the processes without which nothing is computed


def initial_state(run_id: str = "") -> ControlState:
    return ControlState(run_id=run_id)


def _replace(state: ControlState, **changes: Any) -> ControlState:
    return msgspec.structs.replace(state, **changes)


def _new_version(state: ControlState, label: str) -> ControlState:
    epoch = state.weight_epoch + 1
    return _replace(state, weight_epoch=epoch, weight_version=label,
                    version_labels={**state.version_labels, str(epoch): label})


def _update_weight_version(state: ControlState, cmd: UpdateWeightVersion) -> ControlState:
    return _new_version(state, cmd.new_version)


def _start_weight_update(state: ControlState, cmd: StartWeightUpdate) -> ControlState:
    return _replace(state, weight_update_active=True)


def _commit_weight_update(state: ControlState, cmd: CommitWeightUpdate) -> ControlState:
    """Every worker finished: the new weights are in service under a new epoch (and label, if given). A
    version a restarted worker had lost is replaced (a worker still missing some reports it again)."""
    return _new_version(_replace(state, weight_update_active=False, weight_commits=state.weight_commits + 1,
                                 weights_lost=None), cmd.new_version or state.weight_version)


def _abort_weight_update(state: ControlState, cmd: AbortWeightUpdate) -> ControlState:
    return _replace(state, weight_update_active=False)


def _sleep(state: ControlState, cmd: Sleep) -> ControlState:
    if state.sleeping_tags:
        return state  # asleep already: a no-op, as vLLM
    # A level-2 sleep discards the weights: -1 (all of them) until the workers report a count.
    return _replace(state, sleep_level=cmd.level,
                    sleeping_tags=["scheduling"] if cmd.level == 0 else ["weights", "kv_cache"],
                    weights_missing=-1 if cmd.level == 2 else state.weights_missing)


def _weights_missing(state: ControlState, cmd: WeightsMissing) -> ControlState:
    return _replace(state, weights_missing=cmd.count, weights_total=cmd.total)


WEIGHTS_DISCARDED_MESSAGE = "weights were discarded by sleep level 2; load weights first"
WEIGHTS_ZEROED_MESSAGE = "weights were zeroed by /weight_checker reset; load weights first"
RESET_VERSION = "reset"  # the weight version after /weight_checker reset (vLLM's zero_weights)


def weights_discarded_message(missing: int, total: int, version: str = "") -> str | None:
    """The 503 for requests while `missing` of `total` parameters a level-2 sleep discarded (or a
    /weight_checker reset zeroed: version RESET_VERSION) are not loaded again (-1: all of them; None when
    nothing is missing)."""
    n = missing
    if n == 0:
        return None
    why = WEIGHTS_ZEROED_MESSAGE if version == RESET_VERSION else WEIGHTS_DISCARDED_MESSAGE
    how = "a weight update (/update_weights) or POST /collective_rpc {\"method\": \"reload_weights\"} fills them"
    if n < 0:
        return f"{why} ({how})"
    return f"{why} ({n} of {total} parameters still missing; {how})"


def _wake_up(state: ControlState, cmd: WakeUp) -> ControlState:
    tags = cmd.tags or list(SLEEP_TAGS)
    left = [t for t in state.sleeping_tags if t not in tags]
    return _replace(state, sleeping_tags=left, sleep_level=state.sleep_level if left else None)


def _pause(state: ControlState, cmd: Pause) -> ControlState:
    if state.paused is not None:  # pausing twice keeps the first pause (a no-op, as vLLM)
        return state
    return _replace(state, paused=PauseState(cmd.mode, cmd.clear_cache))


def _resume(state: ControlState, cmd: Resume) -> ControlState:
    return _replace(state, paused=None)


def _member_lost(state: ControlState, cmd: MemberLost) -> ControlState:
    if cmd.role not in ENGINE_ROLES:
        return state  # a gateway (or trainer) gone costs only its own requests
    return _replace(state, lost={**state.lost, cmd.name: LostMember(cmd.role, cmd.why)})


def _member_joined(state: ControlState, cmd: MemberJoined) -> ControlState:
    if cmd.name not in state.lost:
        return state
    return _replace(state, lost={n: m for n, m in state.lost.items() if n != cmd.name})


def _weights_lost(state: ControlState, cmd: WeightsLost) -> ControlState:
    return _replace(state, weights_lost=cmd.version or state.weight_version)


def engine_down_message(state: ControlState) -> str | None:
    """The 503 while an engine process is lost (the launcher restarts it; retry), None when none is."""
    if not state.lost:
        return None
    who = "; ".join(f"{n} ({m.why})" for n, m in sorted(state.lost.items()))
    return f"engine process lost: {who}; waiting for it to rejoin (retry later)"


def weights_lost_message(state: ControlState) -> str | None:
    """The 503 while a restarted worker lacks the weight version in service, None when none does."""
    if state.weights_lost is None:
        return None
    return (f"weight version {state.weights_lost!r} was lost: a worker restarted after that update (or its "
            "engine was down while the fleet took it) and no copy "
            "of it was left to load (--weights-recovery-dir keeps one); send the weights again (a full update "
            "through /update_weights or the trainer client) to serve again")


REDUCERS: dict[type, Callable[[ControlState, Any], ControlState]] = {
    Pause: _pause, Resume: _resume, Sleep: _sleep, WakeUp: _wake_up,
    UpdateWeightVersion: _update_weight_version, StartWeightUpdate: _start_weight_update,
    CommitWeightUpdate: _commit_weight_update, AbortWeightUpdate: _abort_weight_update,
    WeightsMissing: _weights_missing,
    MemberLost: _member_lost, MemberJoined: _member_joined, WeightsLost: _weights_lost,
}


def reduce(state: ControlState, cmd: CommandBody) -> ControlState:
    """The state after `cmd` (the same object when the command changes nothing)."""
    reducer = REDUCERS.get(type(cmd))
    return reducer(state, cmd) if reducer is not None else state


def version_label(state: ControlState, epoch: int) -> str:
    return state.version_labels.get(str(epoch), f"epoch-{epoch}")


def is_sleeping(state: ControlState) -> bool:
    """vLLM's definition: paused for any reason, or any tag asleep."""
    return state.paused is not None or bool(state.sleeping_tags)


def sleep_state_label(state: ControlState) -> str:
    """vllm:engine_sleep_state's label."""
    level = state.sleep_level
    if not state.sleeping_tags or level in (None, 0):
        return "awake"
    return "weights_offloaded" if level == 1 else "discard_all"


def rejects_new_requests(state: ControlState) -> bool:
    """abort/wait pauses turn new requests away (HTTP 503, retryable); keep queues them."""
    return state.paused is not None and state.paused.mode in ("abort", "wait")


def as_json(state: ControlState) -> dict[str, Any]:
    """The state as /server_info shows it."""
    return msgspec.to_builtins(state)
