"""The acknowledged control broadcast, as pure state machines (no sockets, no clocks of their own).

Coordinator side, ControlLedger:

    ControlRequest --> publish(seq = last + 1) --> Command on PUB
                          |  waiting = every live acking member
                          v
           Ack(seq, name) removes name;  waiting empty       --> reply ok
           member lost removes name and records it missing   --> reply error naming it
           deadline passes with names still waiting          --> reply error naming them

Member side: bus.follower.Follower (sequence order, gaps, Welcome snapshots, reducers, handlers).

The snapshot is the state that commands leave behind (paused? sleeping? weight version?): a
bus.messages.ControlState, advanced by bus.control_state.reduce when a command is numbered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.control_state import reduce
from bus.messages import (
    Ack,
    AnyResult,
    Command,
    CommandBody,
    ControlState,
    ErrorInfo,
    ErrorKind,
    SchedulerInfo,
    WorkerInfo,
    command_name,
)

ACKING_ROLES = ("scheduler", "worker")


@dataclass(slots=True)
class Pending:
    seq: int
    request_id: str
    requester: bytes | None
    command: CommandBody
    deadline: float
    waiting: set[str]
    results: dict[str, AnyResult] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    errors: list[ErrorInfo] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.errors

    @property
    def name(self) -> str:
        return command_name(self.command)


@dataclass(slots=True)
class Member:
    name: str
    role: str
    pid: int
    last_seen: float
    info: SchedulerInfo | WorkerInfo | None = None

    @property
    def acks(self) -> bool:
        return self.role in ACKING_ROLES


@dataclass(slots=True)
class ControlLedger:
    seq: int = 0
    snapshot: ControlState = field(default_factory=ControlState)
    members: dict[str, Member] = field(default_factory=dict)
    pending: dict[int, Pending] = field(default_factory=dict)

    def join(self, m: Member) -> None:
        """A (re)joining member is welcomed with the snapshot at self.seq, so it owes no ack up to it."""
        self.members[m.name] = m
        for p in self.pending.values():
            p.waiting.discard(m.name)

    def publish(self, command: CommandBody, *, now: float, timeout_s: float,
                request_id: str = "", requester: bytes | None = None) -> tuple[Command, list[Pending]]:
        """Number a command; returns it and any pending entries already complete (no acking members)."""
        self.seq += 1
        self.snapshot = reduce(self.snapshot, command)
        waiting = {n for n, m in self.members.items() if m.acks}
        p = Pending(self.seq, request_id, requester, command, now + timeout_s, waiting)
        self.pending[self.seq] = p
        return Command(self.seq, command), self._collect()

    def ack(self, a: Ack) -> list[Pending]:
        p = self.pending.get(a.seq)
        if p is not None and a.name in p.waiting:
            p.waiting.discard(a.name)
            p.results[a.name] = a.result
            if not a.ok:
                p.errors.append(a.error or ErrorInfo(ErrorKind.UNKNOWN, "failed without saying why", a.name))
        return self._collect()

    def seen(self, name: str, now: float) -> None:
        m = self.members.get(name)
        if m is not None:
            m.last_seen = now

    def lose(self, name: str) -> list[Pending]:
        self.members.pop(name, None)
        for p in self.pending.values():
            if name in p.waiting:
                p.waiting.discard(name)
                p.missing.append(name)
        return self._collect()

    def silent(self, now: float, timeout_s: float) -> list[str]:
        return [n for n, m in self.members.items() if now - m.last_seen > timeout_s]

    def expire(self, now: float) -> list[Pending]:
        for p in self.pending.values():
            if p.waiting and now >= p.deadline:
                p.missing.extend(sorted(p.waiting))
                p.waiting.clear()
        return self._collect()

    def _collect(self) -> list[Pending]:
        done = [p for p in self.pending.values() if not p.waiting]
        for p in done:
            del self.pending[p.seq]
        return done
