"""One engine's step: the batch limits, the admission order, async scheduling.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.argv import Switch, human_int


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs | priority (engine/scheduler/policy.py)
    async_scheduling: bool | None = None  # None: as vLLM, on for accelerators, off on CPU (async_scheduling_on)


def add_args(p: argparse.ArgumentParser) -> None:
    d = SchedulerConfig()
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in the running batch.")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens,
                   help="Token budget of one step; longer prefills are chunked across steps (2k, 8K work).")
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
