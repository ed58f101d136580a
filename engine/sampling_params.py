"""Sampling parameters: one typed record, validated once at the edge, sent to workers as a dict.

Names and defaults follow vLLM's SamplingParams so requests port unchanged. Validation raises
ParamError naming the offending field; the gateway turns that into a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives per sampled token (0: only the sampled)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def validate(self, *, vocab_size: int, max_logprobs: int, max_n: int = 128) -> None:
        _check(1 <= self.n <= max_n, "n", f"n must be between 1 and {max_n}, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0")
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= max_logprobs,
                "logprobs",
                f"Requested sample logprobs of {self.logprobs}, which is greater than max allowed: {max_logprobs}"
                if self.logprobs > max_logprobs
                else f"logprobs must be >= 0, got {self.logprobs}",
            )
        for t in self.stop_token_ids:
            _check(0 <= t < vocab_size, "stop_token_ids",
                   f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**63, "seed", "seed must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
