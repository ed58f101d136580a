"""How much of a step prefill chunks may take, on top of the step's token budget (pure: numbers in, numbers out;
engine/scheduler/policy.py applies them). Two limits:

  - beside decodes (N = rollbus's --prefill-tokens-beside-decodes): while any running sequence is decoding, the
    chunks of long prompts (sequences of more than N tokens) take at most N tokens of a step together. On a CPU a
    step costs in proportion to its tokens, so one 2,048-token chunk would hold every decoding stream for its
    whole prefill; a bounded chunk keeps the step time even. While fewer than `PREFILL_BESIDE_STREAMS` (S)
    sequences decode, d of them, the first long prompt's chunk in the step may take up to N x S / d (up to the
    budget; the others share what is left of N, nothing once it took N or more): the wait that chunk adds,
    summed over the decoding streams, is at most that of N tokens beside S streams. So a burst of long prompts,
    whose first ones decode a few tokens each, is prefilled a prompt at a time in large chunks, while a full
    batch of streams keeps its steps short. Only one prompt takes the larger share: a prompt's first token
    waits for its whole prefill, so a larger chunk for the prompt at the head brings its first token sooner,
    where the same share spread over several prompts (a multi-turn batch's next turns) delays all of them
    (docs/benchmarks.md, "Long prompts beside decoding streams"). Short prompts are still admitted whole within
    the budget (a rollout's batch fills at once), and with nothing decoding long prompts take the whole budget
    (the fastest prefill). A chunk's tokens are weighed by the keys they attend to (1 + position /
    `keys_per_token` each, `cost`), so a chunk late in a long prompt, whose attention costs more, is shorter and
    every step stays about as long;
  - per request (vLLM's --long-prefill-token-threshold): one sequence's chunk is at most this many tokens, unless
    it is the only sequence running or waiting; adaptive (--long-prefill-token-threshold-adaptive) floors it at
    the budget's fair share (budget // sequences running and waiting), as vLLM does.
"""

from __future__ import annotations

import math

# A prefill token's share of attention grows with its position: at about this many keys it costs as much again
# as the token's layer GEMMs on a CPU (SmolLM2 fp32 measured: a 256-token chunk beside 32 decodes takes 0.56 s at
# position 0 and ~1.4 s at 1,500; the FLOPs alone say ~3,000 keys for SmolLM2 and Qwen3, softmax's exps the rest).
PREFILL_KEYS_PER_TOKEN = 1024
# The decoding streams at which the beside-decodes limit holds as given; fewer streams share the same summed wait,
# each waiting longer. 32: the batch beside which the CPU default of 256 was measured (workload L's streams and
# M's conversations; docs/benchmarks.md, "Long prompts beside decoding streams").
PREFILL_BESIDE_STREAMS = 32


def chunk_limits(budget: int, beside: int, streams: int, decoding: int, per_request: int, adaptive: bool,
                 eligible: int) -> tuple[float, float, int, int]:
    """One step's (weight left for long prompts' chunks, the weight the step's first long chunk may take, the
    length over which a prompt is long, one sequence's chunk), for a step of `budget` tokens, the beside-decodes
    limit `beside` (0: none) holding as given from `streams` decoding sequences on (0: from the first),
    `decoding` sequences decoding, vLLM's per-request threshold `per_request` (0: none) and its `adaptive` floor,
    and `eligible` sequences running and waiting. The first long chunk weighs at most max(left, first); every
    chunk's weight comes off `left`."""
    long_left, long_first, long_over = math.inf, math.inf, budget  # no limit
    if 0 < beside < budget and decoding:
        long_left, long_over = beside, beside
        long_first = min(budget, max(beside, beside * streams // decoding)) if decoding < streams else beside
    if per_request <= 0 or eligible <= 1:
        return long_left, long_first, long_over, budget
    if adaptive:
        per_request = max(per_request, budget // eligible)
    return long_left, long_first, long_over, per_request


def cost(start: int, n: int, keys: int) -> float:
    """What n prefill tokens from position `start` weigh against the beside-decodes limit: each token 1, plus
    the keys it attends to over `keys` (0: tokens alone)."""
    return n + (n * start + n * n / 2) / keys if keys > 0 else n


def fit(left: float, start: int, want: int, keys: int) -> int:
    """The most of `want` tokens from `start` that weigh at most `left` (at least 1 while anything is left)."""
    if left <= 0:
        return 0
    if cost(start, want, keys) <= left:
        return want
    if keys <= 0:
        return max(1, int(left))
    b = 1 + start / keys  # n * b + n^2 / (2 keys) = left
    n = int(keys * (math.sqrt(b * b + 2 * left / keys) - b))
    return max(1, min(want, n))
