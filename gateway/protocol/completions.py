"""POST /v1/completions: the request body, as vLLM accepts it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from bus.sampling_params import ParamError, SamplingParams
from gateway.protocol.fields import _schema
from gateway.protocol.refused import REFUSED_COMPLETION, refuse_unsupported
from gateway.protocol.sampling import _SamplingRequest

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt = Field(json_schema_extra={"minItems": 1, "minLength": 1,
                                              "items": {"minItems": 1, "minimum": 0, "minLength": 1}})
    # vLLM and OpenAI: 16; explicit null means "the rest of the context"; 0 only with echo
    max_tokens: int | None = _schema(16, minimum=0)
    logprobs: int | None = _schema(minimum=-1)
    echo: bool | None = False
    suffix: str | None = _schema(enum=[None, ""])
    add_special_tokens: bool = True
    prompt_embeds: bytes | list[bytes] | None = _schema(enum=[None, ""], maxItems=0)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a text or a list of token ids (OpenAI batch semantics)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out:
            raise ParamError("prompt", "The prompt cannot be empty")
        return out

    def check(self) -> None:
        refuse_unsupported(self, REFUSED_COMPLETION)
        self._check_common()
        if self.logprobs is not None and self.logprobs < -1:
            raise ParamError("logprobs", "`logprobs` must be a positive value or -1.")

    @property
    def echo_only(self) -> bool:
        """vLLM: echo with max_tokens 0 scores the prompt (one token is generated and not shown)."""
        return bool(self.echo) and self.max_tokens == 0

    def effective_prompt_logprobs(self) -> int | None:
        """vLLM: with echo, prompt_logprobs defaults to logprobs (the echoed prompt gets logprobs too)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of one prompt; default_max_tokens (the rest of the context) fills a null."""
        self.check()
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if self.echo_only:
            max_tokens = 1
        return self._sampling(max_tokens, self.logprobs, defaults, self.effective_prompt_logprobs())
