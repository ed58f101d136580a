"""Pieces of the OpenAI response bodies the endpoints share: the usage object and logprob values JSON can
carry."""

from __future__ import annotations

import math
from typing import Any

MAX_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps to this


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}
    u["prompt_tokens_details"] = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    return u


def clamp_logprob(x: float) -> float:
    """vLLM: -inf (and NaN) become -9999.0, which JSON can carry."""
    return MAX_LOGPROB_FLOOR if math.isnan(x) else max(MAX_LOGPROB_FLOOR, x)
