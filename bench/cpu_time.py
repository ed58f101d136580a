"""CPU seconds of a process tree (a server and every process under it), from /proc: on a host shared with
other work a run's wall time grows with the load, its CPU time much less, so benchmarks report both."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # the fields after the command name
    except OSError:
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far; a gone process counts 0."""
    return sum((int(s[11]) + int(s[12])) / _TICK for pid in pids if (s := _stat(pid)) is not None)


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants (0 where /proc is missing)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and (s := _stat(int(name))) is not None:
            parents[int(name)] = int(s[1])  # ppid; utime and stime are fields 14 and 15 of stat
            times[int(name)] = (int(s[11]) + int(s[12])) / _TICK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += [c for c, p in parents.items() if p == pid]
    return total
