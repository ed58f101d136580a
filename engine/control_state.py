"""The engine's control state (what the coordinator snapshots for late joiners), and how each stateful
command changes it. Pure; shared by the coordinator (snapshot), the scheduler and the gateway (to
answer /is_paused without a round trip).
"""

from __future__ import annotations

from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


def initial_state() -> dict[str, Any]:
    return {
        "paused": None,  # None, or {"mode": abort|wait|keep, "clear_cache": bool}
        "sleep_level": None,  # None when awake, else the level of the sleep in force
        "sleeping_tags": [],  # level 0: ["scheduling"]; levels 1 and 2: ["weights", "kv_cache"]
        # Weight versions are free-form labels (vLLM); the engine numbers them with an epoch that travels
        # in every StepPlan/StepResult/RequestOutput and keys the prefix cache.
        "weight_version": "default",
        "weight_epoch": 0,
        "version_labels": {"0": "default"},
        # Between start_weight_update and its commit or abort: the scheduler holds steps meanwhile.
        "weight_update_active": False,
        # A level-2 sleep discards the weights: requests are refused (503) until every parameter is loaded
        # again. -1: all of them (until the workers report a count); the workers' acks update it (coordinator).
        "weights_missing": 0,
        "weights_total": 0,
    }


def _update_weight_version(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["weight_epoch"] = int(state.get("weight_epoch", 0)) + 1
    state["weight_version"] = str(args["new_version"])
    state.setdefault("version_labels", {})[str(state["weight_epoch"])] = state["weight_version"]


def _start_weight_update(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["weight_update_active"] = True


def _commit_weight_update(state: dict[str, Any], args: dict[str, Any]) -> None:
    """Every worker finished: the new weights are in service under a new epoch (and label, if given)."""
    state["weight_update_active"] = False
    _update_weight_version(state, {"new_version": args.get("new_version") or state.get("weight_version", "default")})


def _abort_weight_update(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["weight_update_active"] = False


def version_label(state: dict[str, Any], epoch: int) -> str:
    return state.get("version_labels", {}).get(str(epoch), f"epoch-{epoch}")


def _sleep(state: dict[str, Any], args: dict[str, Any]) -> None:
    if state.get("sleeping_tags"):
        return  # asleep already: a no-op, as vLLM
    level = int(args["level"])
    state["sleep_level"] = level
    state["sleeping_tags"] = ["scheduling"] if level == 0 else ["weights", "kv_cache"]
    if level == 2:
        state["weights_missing"] = -1


def _weights_missing(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["weights_missing"], state["weights_total"] = int(args["count"]), int(args.get("total", 0))


WEIGHTS_DISCARDED_MESSAGE = "weights were discarded by sleep level 2; load weights first"


def weights_discarded_message(state: dict[str, Any]) -> str | None:
    """The 503 for requests while discarded weights are not all loaded again (None when they are)."""
    n = int(state.get("weights_missing", 0) or 0)
    if n == 0:
        return None
    how = "a weight update (/update_weights) or POST /collective_rpc {\"method\": \"reload_weights\"} fills them"
    if n < 0:
        return f"{WEIGHTS_DISCARDED_MESSAGE} ({how})"
    return f"{WEIGHTS_DISCARDED_MESSAGE} ({n} of {state.get('weights_total', '?')} parameters still missing; {how})"


def _wake_up(state: dict[str, Any], args: dict[str, Any]) -> None:
    tags = args.get("tags") or list(SLEEP_TAGS)
    left = [t for t in state.get("sleeping_tags", []) if t not in tags]
    state["sleeping_tags"] = left
    if not left:
        state["sleep_level"] = None


def is_sleeping(state: dict[str, Any]) -> bool:
    """vLLM's definition: paused for any reason, or any tag asleep."""
    return state.get("paused") is not None or bool(state.get("sleeping_tags"))


def sleep_state_label(state: dict[str, Any]) -> str:
    """vllm:engine_sleep_state's label."""
    level = state.get("sleep_level")
    if not state.get("sleeping_tags") or level in (None, 0):
        return "awake"
    return "weights_offloaded" if level == 1 else "discard_all"


def _pause(state: dict[str, Any], args: dict[str, Any]) -> None:
    if state.get("paused") is None:  # pausing twice keeps the first pause (a no-op, as vLLM)
        state["paused"] = {"mode": args["mode"], "clear_cache": bool(args.get("clear_cache", True))}


def _resume(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["paused"] = None


REDUCERS = {"pause": _pause, "resume": _resume, "sleep": _sleep, "wake_up": _wake_up,
            "update_weight_version": _update_weight_version, "start_weight_update": _start_weight_update,
            "commit_weight_update": _commit_weight_update, "abort_weight_update": _abort_weight_update,
            "weights_missing": _weights_missing}

# Weight-transfer commands (gateway/weight_routes.py); the scheduler holds steps from start to commit/abort.
WEIGHT_UPDATE_COMMANDS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                          "finish_weight_update", "commit_weight_update", "abort_weight_update",
                          "shutdown_weight_transfer_engine", "weight_checker")


def apply(state: dict[str, Any], command: str, args: dict[str, Any]) -> None:
    reducer = REDUCERS.get(command)
    if reducer is not None:
        reducer(state, args)


def rejects_new_requests(state: dict[str, Any]) -> bool:
    """abort/wait pauses turn new requests away (HTTP 503, retryable); keep queues them."""
    paused = state.get("paused")
    return paused is not None and paused["mode"] in ("abort", "wait")


PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
