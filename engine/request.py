"""Per-sequence state the scheduler keeps. Pure data: no sockets, no tensors (numpy views of routed experts
at most, on their way to the gateway)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bus.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float = 0.0
    client: bytes = b""  # identity of the gateway that owns it
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    # async scheduling (engine.scheduler.policy): positions and samples of steps planned but whose results are
    # not in yet; the next plan starts after them
    inflight_tokens: int = 0
    inflight_samples: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the leading full blocks, in order
    # mixed-window models (engine.window_blocks): the sliding-window layers' own blocks, FREED before the window
    window_table: list[int] = field(default_factory=list)
    num_released: int = 0  # leading entries of the windowed table (block_table, or window_table) given back
    sent_to_workers: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0
    order: int = 0  # how many sequences the scheduler had been given before this one (a tie-break)
    kv_epoch: int | None = None  # weight epoch of the oldest KV this sequence holds (None: holds none)
    state_slot: int = -1  # hybrid models: its recurrent-state slot while running (engine.scheduler.policy)
    # routed experts computed but not yet sent to the gateway: (first position, rows) pieces whose rows are
    # read-only views of a StepResult's array (engine.routed_experts)
    routed_pieces: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
