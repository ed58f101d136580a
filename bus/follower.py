"""Following the numbered command stream: the one piece of code every member (scheduler, workers,
gateway; sync or asyncio) uses to apply the coordinator's commands. Pure: no sockets, no clocks. The
transports (bus.member.MemberLink for poll loops, gateway.engine_client.EngineClient for asyncio) feed
it what arrives and send the acks it returns.

    Welcome(seq, snapshot) --> state = snapshot, position = seq; replays buffered commands after seq
                               (ignored while following: only a resync takes a new snapshot)
    Command(seq)           --> before the Welcome: buffered (the Welcome travels on another pipe)
                               seq <= position: dropped (covered by the snapshot, or a duplicate)
                               seq == position + 1: applied
                               otherwise: SequenceGap -> the transport resyncs (re-Hello, new snapshot)

Applying a command: the follower first advances `state` with bus.control_state.reduce (so every
member holds the same ControlState at the same seq; `before` keeps the state it replaced), then calls
the handler the actor registered for the command's type (`follower.on(Pause, self._pause)`). The
handler's return value (one of the result structs its command declares in RESULTS, or None) travels back
in the Ack; an exception becomes a failed Ack
with a typed ErrorInfo (kind, message, member, and status/param/tensor when the exception has them).
A command without a handler is acked with an empty result (it did not concern this member).

A command that completes later (a pause in wait mode: ack once the running requests have finished)
returns DEFER; the actor then calls `complete()`. Later commands are held until then, so commands are
still applied, and acked, strictly in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from bus.control_state import reduce
from bus.messages import (
    Ack,
    AnyResult,
    Command,
    CommandBody,
    ControlState,
    ErrorInfo,
    ErrorKind,
    Welcome,
    command_name,
)

log = structlog.get_logger()

DEFER = object()  # returned by a handler: the actor acks later through complete()

Handler = Callable[[Any], Any]  # (command body) -> one of its RESULTS | None | DEFER


class SequenceGap(Exception):
    def __init__(self, expected: int, got: int):
        super().__init__(f"control sequence gap: expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


class Refused(RuntimeError):
    """The coordinator refused us (protocol mismatch)."""


def error_info(e: BaseException, member: str) -> ErrorInfo:
    """An exception as it travels. Errors that know their HTTP status (WeightSyncError: 400 for bad
    metadata, 409 for wrong state, ...) and the field or tensor they concern pass them on."""
    status, param, tensor = getattr(e, "status", None), getattr(e, "param", None), getattr(e, "tensor", None)
    return ErrorInfo(type(e).__name__, str(e), member, status if isinstance(status, int) else None,
                     param if isinstance(param, str) else None, tensor if isinstance(tensor, str) else None)


class Follower:
    def __init__(self, name: str, handlers: dict[type, Handler] | None = None, *,
                 default: Handler | None = None):
        self.name = name
        self.handlers: dict[type, Handler] = dict(handlers or {})
        self.default = default  # for commands without a handler (test members that record everything)
        self.seq: int | None = None  # last applied; None until welcomed
        self.state = ControlState()
        self.before = self.state  # the state the command being handled replaced
        self.current: Command | None = None  # the command being handled
        self.welcomes = 0  # snapshots taken (1 at join, +1 per resync)
        self.deferred: Command | None = None
        self._early: list[Command] = []
        self._held: list[Command] = []

    def on(self, command_type: type[CommandBody], handler: Handler) -> None:
        self.handlers[command_type] = handler

    @property
    def welcomed(self) -> bool:
        return self.seq is not None

    def welcome(self, w: Welcome) -> list[Ack]:
        """Start from a snapshot; returns the acks of buffered commands that come after it."""
        if not w.accepted:
            raise Refused(w.reason)
        if self.seq is not None:
            # Following already (a duplicate, or the answer to a rejoin's Hello): keep applying the stream
            # command by command, so no handler is skipped; only a resync() takes a new snapshot.
            return []
        self.seq, self.state = w.seq, w.snapshot
        self.welcomes += 1
        early, self._early = sorted(self._early, key=lambda c: c.seq), []
        acks: list[Ack] = []
        for c in early:
            acks += self.command(c)
        return acks

    def command(self, cmd: Command) -> list[Ack]:
        """The acks to send now. Raises SequenceGap (call resync(), then say Hello again)."""
        if self.seq is None:
            self._early.append(cmd)
            return []
        if cmd.seq <= self.seq:
            return []
        if cmd.seq != self.seq + 1:
            raise SequenceGap(self.seq + 1, cmd.seq)
        self.seq = cmd.seq
        return self._run([cmd])

    def resync(self) -> None:
        """Drop our position; the next Welcome's snapshot replaces the state (zguide "Clone")."""
        self.seq = None
        self._early = []

    def complete(self, result: AnyResult = None, error: ErrorInfo | None = None) -> list[Ack]:
        """Ack the deferred command, then apply the commands held behind it."""
        cmd, self.deferred = self.deferred, None
        if cmd is None:
            return []
        acks = [Ack(cmd.seq, self.name, error is None, error, result) if error is not None else
                self._ack(cmd, result)]
        held, self._held = self._held, []
        return acks + self._run(held)

    def _run(self, cmds: list[Command]) -> list[Ack]:
        acks: list[Ack] = []
        for cmd in cmds:
            if self.deferred is not None:
                self._held.append(cmd)
                continue
            self.before, self.state = self.state, reduce(self.state, cmd.body)
            self.current = cmd
            handler = self.handlers.get(type(cmd.body), self.default)
            try:
                result = handler(cmd.body) if handler is not None else None
            except Exception as e:  # a failed command is reported, never fatal to the member
                log.exception("bus.command_failed", member=self.name, command=command_name(cmd.body))
                acks.append(Ack(cmd.seq, self.name, False, error_info(e, self.name)))
                continue
            finally:
                self.current = None
            if result is DEFER:
                self.deferred = cmd
            else:
                acks.append(self._ack(cmd, result))
        return acks

    def _ack(self, cmd: Command, result: Any) -> Ack:
        """A result the command does not declare is a failed ack, not a lost one."""
        declared = type(cmd.body).RESULTS
        if result is None or isinstance(result, declared):
            return Ack(cmd.seq, self.name, True, None, result)
        want = ", ".join(t.__name__ for t in declared) or "None"
        return Ack(cmd.seq, self.name, False, ErrorInfo(
            ErrorKind.BAD_RESULT, f"handler of {command_name(cmd.body)} returned {type(result).__name__}, "
            f"not one of its results ({want})", self.name))
