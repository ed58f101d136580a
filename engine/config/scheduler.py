"""One engine's step: the batch limits, the admission order, async scheduling.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.argv import Switch, human_int, non_negative
from engine.scheduler.chunk_limits import PREFILL_BESIDE_STREAMS


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs | priority (engine/scheduler/policy.py)
    async_scheduling: bool | None = None  # None: as vLLM, on for accelerators, off on CPU (async_scheduling_on)
    prefill_tokens_beside_decodes: int | None = None  # None: CPU_PREFILL_BESIDE_DECODES on CPU, off elsewhere
    long_prefill_token_threshold: int = 0  # vLLM's (0: off)
    long_prefill_token_threshold_adaptive: bool = False  # vLLM's


# A step's prefill tokens on a CPU while sequences decode: a decode step of SmolLM2 or Qwen3-0.6B costs about as
# much as 60-90 prefill tokens (reading every weight once, plus the decodes), so 256 prefill tokens keep a step
# within about 3x a decode step's time while prefilling at ~80% of the pure-prefill rate (docs/benchmarks.md, L).
CPU_PREFILL_BESIDE_DECODES = 256


def add_args(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in the running batch.")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens,
                   help="Token budget of one step; longer prefills are chunked across steps (2k, 8K work).")
    g.add_argument("--prefill-tokens-beside-decodes", type=non_negative("--prefill-tokens-beside-decodes"),
                   default=d.prefill_tokens_beside_decodes,
                   metavar="N",
                   help="While any sequence is decoding, the chunks of prompts longer than N take at most N tokens "
                        "of a step together (the rest waits for the next steps), so a long prompt does not stall the "
                        f"decoding streams: on a CPU a step's time grows with its tokens. While only d < "
                        f"{PREFILL_BESIDE_STREAMS} sequences decode, the first long prompt's chunk may take up to "
                        f"N x {PREFILL_BESIDE_STREAMS} / d tokens (the streams' summed wait kept), one prompt at a "
                        "time. With nothing decoding, prefills take the whole --max-num-batched-tokens. Default: "
                        f"{CPU_PREFILL_BESIDE_DECODES} on CPU, 0 (no limit, as vLLM) on accelerators.")
    g.add_argument("--long-prefill-token-threshold", type=human_int, default=d.long_prefill_token_threshold,
                   help="vLLM's: one request's prefill chunk per step is at most this many tokens, unless it is the "
                        "only request running or waiting (0: no limit).")
    g.add_argument("--long-prefill-token-threshold-adaptive", action=Switch,
                   default=d.long_prefill_token_threshold_adaptive,
                   help="vLLM's: floor --long-prefill-token-threshold at --max-num-batched-tokens divided by the "
                        "requests running and waiting.")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="Which waiting request is admitted next and which running one is preempted when KV blocks run "
                        "out (vLLM's flag). fcfs: arrival order. priority: by each request's `priority` (lower "
                        "first; ties by arrival), on /v1/completions, /v1/chat/completions and "
                        "/inference/v1/generate; a preempted request goes back by its priority, and the victim is "
                        "the running request with the highest (priority, arrival). Without it a priority other than "
                        "0 is a 400.")
    g.add_argument("--async-scheduling", action=Switch, default=d.async_scheduling,
                   help="Plan step N+1 while step N computes (vLLM's flag): the workers start the next step the "
                        "moment they finish one, instead of waiting for the results' round trip and the planning. "
                        "A sequence that stops at EOS or a stop token computes one token more, which is dropped; a "
                        "new request starts one step later. Default as vLLM: on for accelerators, off on CPU "
                        "(--async-scheduling / --no-async-scheduling choose).")


def async_scheduling_on(cfg: SchedulerConfig, device: str) -> bool:
    """--async-scheduling as given, else vLLM's default for the workers' device (off on CPU, where vLLM's CPU
    platform turns it off, on for CUDA and NPU)."""
    given = cfg.async_scheduling
    if given is not None:
        return bool(given)
    return device.split(":")[0] != "cpu"


def prefill_beside_decodes(cfg: SchedulerConfig, device: str) -> int:
    """--prefill-tokens-beside-decodes as given, else its default for the workers' device (0: no limit)."""
    given = cfg.prefill_tokens_beside_decodes
    if given is not None:
        return given
    return CPU_PREFILL_BESIDE_DECODES if device.split(":")[0] == "cpu" else 0
