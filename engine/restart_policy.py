"""When `rollbus serve` restarts a dead child, and when it gives up. Pure: the clock is passed in.

A child may die `max_restarts` times within WINDOW_S and is restarted each time, after a delay that doubles
with every recent death (FIRST_DELAY_S, then 2x, capped at MAX_DELAY_S), so a crash-looping child does not
spin; one more death within the window and the launcher stops everything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 8.0


@dataclass
class RestartPolicy:
    max_restarts: int
    window_s: float = WINDOW_S
    deaths: dict[str, deque[float]] = field(default_factory=dict)

    def on_exit(self, name: str, now: float) -> float | None:
        """A child exited at `now`: seconds to wait before restarting it, or None to give up."""
        recent = self.deaths.setdefault(name, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return None
        recent.append(now)
        return min(FIRST_DELAY_S * 2 ** (len(recent) - 1), MAX_DELAY_S)

    def recent(self, name: str) -> int:
        return len(self.deaths.get(name, ()))
