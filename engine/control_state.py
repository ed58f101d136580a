"""The engine's control state (what the coordinator snapshots for late joiners), and how each stateful
command changes it. Pure; shared by the coordinator (snapshot), the scheduler and the gateway (to
answer /is_paused without a round trip).
"""

from __future__ import annotations

from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


def initial_state() -> dict[str, Any]:
    return {"paused": None}  # None, or {"mode": abort|wait|keep, "clear_cache": bool}


def _pause(state: dict[str, Any], args: dict[str, Any]) -> None:
    if state.get("paused") is None:  # pausing twice keeps the first pause (a no-op, as vLLM)
        state["paused"] = {"mode": args["mode"], "clear_cache": bool(args.get("clear_cache", True))}


def _resume(state: dict[str, Any], args: dict[str, Any]) -> None:
    state["paused"] = None


REDUCERS = {"pause": _pause, "resume": _resume}


def apply(state: dict[str, Any], command: str, args: dict[str, Any]) -> None:
    reducer = REDUCERS.get(command)
    if reducer is not None:
        reducer(state, args)


def rejects_new_requests(state: dict[str, Any]) -> bool:
    """abort/wait pauses turn new requests away (HTTP 503, retryable); keep queues them."""
    paused = state.get("paused")
    return paused is not None and paused["mode"] in ("abort", "wait")


PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
