"""Which engine a request goes to (data parallelism): pure policy, no sockets.

- A request with the `X-data-parallel-rank: i` header goes to engine i (vLLM's header, for a DP-aware
  router in front): a value that is not an integer, or names no engine, is a 400 naming the header; an
  engine that is down answers 503 like a dead single engine.
- Otherwise the live engine with the least outstanding work: fewest requests in flight, then fewest
  tokens in flight (prompt plus what may still be generated), then the one after the last pick (round
  robin among equals, so a burst of equal requests alternates instead of piling onto engine 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADER = "X-data-parallel-rank"


class RankHeaderError(ValueError):
    """The header's value cannot name an engine (a 400 naming the header)."""


def parse_rank_header(value: str | None, num_engines: int) -> int | None:
    """The engine the header names, None without the header."""
    if value is None:
        return None
    text = value.strip()
    try:
        rank = int(text)
    except ValueError:
        raise RankHeaderError(f"{HEADER} must be an integer engine index, got {value!r}") from None
    if not 0 <= rank < num_engines:
        raise RankHeaderError(f"{HEADER} {rank} is out of range: this server has {num_engines} data-parallel "
                              f"engine(s), 0..{num_engines - 1}")
    return rank


@dataclass(slots=True)
class EngineLoad:
    requests: int = 0  # engine requests in flight
    tokens: int = 0  # their prompt tokens plus the tokens they may still generate


@dataclass(slots=True)
class Balancer:
    """The gateway's view of each engine's outstanding work; `pick` chooses, `add`/`done` keep it."""

    loads: list[EngineLoad]
    last: int = -1
    _owner: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (engine, tokens)

    @classmethod
    def of(cls, num_engines: int) -> "Balancer":
        return cls([EngineLoad() for _ in range(num_engines)])

    def pick(self, alive: list[bool]) -> int | None:
        """The live engine with the least outstanding work (None: every engine is down)."""
        n = len(self.loads)
        order = [(self.last + 1 + k) % n for k in range(n)]  # after the last pick first: ties rotate
        live = [e for e in order if alive[e]]
        if not live:
            return None
        best = min(live, key=lambda e: (self.loads[e].requests, self.loads[e].tokens))
        self.last = best
        return best

    def add(self, request_id: str, engine: int, tokens: int) -> None:
        self._owner[request_id] = (engine, tokens)
        load = self.loads[engine]
        load.requests += 1
        load.tokens += tokens

    def done(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        if owner is None:
            return
        engine, tokens = owner
        load = self.loads[engine]
        load.requests -= 1
        load.tokens -= tokens

    def engine_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return None if owner is None else owner[0]

    def open_on(self, engine: int) -> list[str]:
        return [r for r, (e, _) in self._owner.items() if e == engine]
