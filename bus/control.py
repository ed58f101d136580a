"""The acknowledged control broadcast, as pure state machines (no sockets, no clocks of their own).

Coordinator side, ControlLedger:

    ControlRequest --> publish(seq = last + 1) --> Command on PUB
                          |  waiting = every live acking member
                          v
           Ack(seq, name) removes name;  waiting empty       --> reply ok
           member lost removes name and records it missing   --> reply error naming it
           deadline passes with names still waiting          --> reply error naming them

Member side, ControlFollower: applies commands strictly in seq order. Before its Welcome it buffers what
arrives on the SUB socket (the Welcome travels on another pipe and may come later); the Welcome's
snapshot covers every seq <= welcome.seq, so buffered commands up to it are dropped and later ones
replayed. A command that skips a seq raises SequenceGap: the member resyncs from a fresh snapshot
rather than drift.

The snapshot is the state that commands leave behind (paused? sleeping? weight version?). The ledger
is given a reducer per stateful command (engine.control_state); stateless ones (health, shutdown) have
none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from bus.messages import Ack, Command

ACKING_ROLES = ("scheduler", "worker")

Reducer = Callable[[dict[str, Any], dict[str, Any]], None]  # (snapshot, command args) -> mutate snapshot


class SequenceGap(Exception):
    def __init__(self, expected: int, got: int):
        super().__init__(f"control sequence gap: expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


@dataclass(slots=True)
class ControlFollower:
    seq: int | None = None  # last applied; None until welcomed
    _early: list[Command] = field(default_factory=list)

    def welcome(self, seq: int) -> list[Command]:
        """Start from a snapshot at `seq`; returns buffered commands that come after it, in order."""
        self.seq = seq
        early, self._early = sorted(self._early, key=lambda c: c.seq), []
        out: list[Command] = []
        for c in early:
            out += self.accept(c)
        return out

    def accept(self, cmd: Command) -> list[Command]:
        """Commands to apply now (zero or one). Raises SequenceGap."""
        if self.seq is None:
            self._early.append(cmd)
            return []
        if cmd.seq <= self.seq:
            return []  # already covered by the snapshot or applied
        if cmd.seq != self.seq + 1:
            raise SequenceGap(self.seq + 1, cmd.seq)
        self.seq = cmd.seq
        return [cmd]


@dataclass(slots=True)
class Pending:
    seq: int
    request_id: str
    requester: bytes | None
    command: str
    deadline: float
    waiting: set[str]
    results: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.errors

    def error_text(self) -> str:
        parts = list(self.errors)
        if self.missing:
            parts.append(f"no ack from {', '.join(sorted(self.missing))}")
        return "; ".join(parts)


@dataclass(slots=True)
class Member:
    name: str
    role: str
    pid: int
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def acks(self) -> bool:
        return self.role in ACKING_ROLES


@dataclass(slots=True)
class ControlLedger:
    seq: int = 0
    snapshot: dict[str, Any] = field(default_factory=dict)
    members: dict[str, Member] = field(default_factory=dict)
    pending: dict[int, Pending] = field(default_factory=dict)
    reducers: dict[str, Reducer] = field(default_factory=dict)

    def join(self, m: Member) -> None:
        """A (re)joining member is welcomed with the snapshot at self.seq, so it owes no ack up to it."""
        self.members[m.name] = m
        for p in self.pending.values():
            p.waiting.discard(m.name)

    def publish(self, command: str, args: dict[str, Any], *, now: float, timeout_s: float,
                request_id: str = "", requester: bytes | None = None) -> tuple[Command, list[Pending]]:
        """Number a command; returns it and any pending entries already complete (no acking members)."""
        self.seq += 1
        reducer = self.reducers.get(command)
        if reducer:
            reducer(self.snapshot, args)
        waiting = {n for n, m in self.members.items() if m.acks}
        p = Pending(self.seq, request_id, requester, command, now + timeout_s, waiting)
        self.pending[self.seq] = p
        return Command(self.seq, command, args), self._collect()

    def ack(self, a: Ack) -> list[Pending]:
        p = self.pending.get(a.seq)
        if p is not None and a.name in p.waiting:
            p.waiting.discard(a.name)
            p.results[a.name] = a.result
            if not a.ok:
                p.errors.append(f"{a.name}: {a.error}")
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
