"""Which engines and workers a deployment has, and what each is called: pure, no sockets, no devices.

An engine is one scheduler plus its tensor-parallel workers. With `--data-parallel-size M` there are M
engines, numbered 0..M-1 (the data-parallel rank). Names (the bus member names, ipc socket names and
the `engine` label of /metrics all follow them):

- scheduler of engine e: `scheduler` when M = 1 (today's name), else `scheduler-<e>`;
- worker with tensor-parallel rank t of engine e: `worker-<g>`, g = e x tp + t (the global worker index;
  with M = 1 and tp = 1 this is `worker-0`, as before);
- the trainer-facing collective rank of that worker is rank_offset + g.

A host runs the engines [start, start + local) (`--data-parallel-start-rank`, `--data-parallel-size-local`);
the coordinator and the gateway run on the host with start rank 0 (the head). Launcher, coordinator,
gateway, schedulers and workers all read their layout from here, so they agree without talking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SCHEDULER = re.compile(r"scheduler(?:-(\d+))?")
_WORKER = re.compile(r"worker-(\d+)")


@dataclass(frozen=True, slots=True)
class Topology:
    dp: int = 1  # engines in the whole deployment
    tp: int = 1  # workers per engine
    dp_local: int = 1  # engines on this host
    dp_start: int = 0  # the first engine on this host

    @classmethod
    def from_config(cls, cfg) -> "Topology":
        """From an engine.config.EngineConfig's parallel flags (read by attribute: bus/ imports nothing above it)."""
        p = cfg.parallel
        dp = p.data_parallel_size
        return cls(dp=dp, tp=p.tensor_parallel_size,
                   dp_local=dp if p.data_parallel_size_local is None else p.data_parallel_size_local,
                   dp_start=p.data_parallel_start_rank)

    def problems(self) -> list[str]:
        """Why this layout cannot run (empty: it can); each names the flag and value."""
        out = []
        if self.dp < 1:
            out.append(f"--data-parallel-size must be at least 1, got {self.dp}")
        if self.tp < 1:
            out.append(f"--tensor-parallel-size must be at least 1, got {self.tp}")
        if self.dp_local < 0 or self.dp_local > self.dp:
            out.append(f"--data-parallel-size-local {self.dp_local} must be between 0 and --data-parallel-size "
                       f"{self.dp}")
        if self.dp_start < 0 or self.dp_start + self.dp_local > self.dp:
            out.append(f"--data-parallel-start-rank {self.dp_start} with --data-parallel-size-local "
                       f"{self.dp_local} names engines beyond --data-parallel-size {self.dp} "
                       f"(engines {self.dp_start}..{self.dp_start + self.dp_local - 1})")
        return out

    # --- what exists -------------------------------------------------------------------------------

    @property
    def engines(self) -> range:
        return range(self.dp)

    @property
    def local_engines(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_local)

    @property
    def is_head(self) -> bool:
        """This host runs the coordinator and the gateway."""
        return self.dp_start == 0

    @property
    def world_size(self) -> int:
        """Workers of the whole deployment (vLLM's world size with data parallelism included)."""
        return self.dp * self.tp

    # --- names -------------------------------------------------------------------------------------

    def scheduler_name(self, engine: int) -> str:
        return "scheduler" if self.dp == 1 else f"scheduler-{engine}"

    def worker_index(self, engine: int, tp_rank: int) -> int:
        return engine * self.tp + tp_rank

    def worker_name(self, engine: int, tp_rank: int) -> str:
        return f"worker-{self.worker_index(engine, tp_rank)}"

    def worker_names(self, engine: int) -> list[str]:
        return [self.worker_name(engine, t) for t in range(self.tp)]

    def members(self, engine: int) -> list[str]:
        """The processes without which engine `engine` computes nothing."""
        return [self.scheduler_name(engine), *self.worker_names(engine)]

    def engine_of(self, name: str) -> int | None:
        """The engine a scheduler or worker name belongs to (None: not an engine process, or none of ours)."""
        m = _SCHEDULER.fullmatch(name)
        if m:
            e = 0 if m.group(1) is None else int(m.group(1))
            return e if e in self.engines and self.scheduler_name(e) == name else None
        m = _WORKER.fullmatch(name)
        if m:
            e = int(m.group(1)) // self.tp
            return e if e in self.engines else None
        return None

    def local_device(self, engine: int, tp_rank: int) -> int:
        """The device index on this host of a worker: engines of a host take consecutive devices."""
        return (engine - self.dp_start) * self.tp + tp_rank

    def donor(self, engine: int, tp_rank: int) -> str | None:
        """Whose weights a restarted worker can take: the worker with the same tensor-parallel rank (so the
        same shard) in another engine of this host (the copy is a file in a private folder), or None."""
        for e in self.local_engines:
            if e != engine:
                return self.worker_name(e, tp_rank)
        return None

    def endpoint_suffix(self, engine: int) -> str:
        """The per-engine sockets (requests, plans, results): engine 0 keeps today's names and ports."""
        return "" if engine == 0 else f"-{engine}"

    def port_offset(self, engine: int) -> int:
        """tcp: engine 0's trio at --bus-port-base + 0..2 (control +3, commands +4), engine e >= 1 at
        base + 3e + 2 .. 3e + 4 (engine 1: +5..+7, engine 2: +8..+10)."""
        return 0 if engine == 0 else 3 * engine + 2
