"""POST /inference/v1/generate (tokens in, tokens out): the request body and its sampling_params (vLLM's
SamplingParams: engine field names and defaults)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, StrictInt

from bus.sampling_params import ParamError, SamplingParams
from gateway.protocol.fields import (
    _BAD_WORDS,
    _EMPTY_ARRAY,
    _EMPTY_OBJECT,
    _I64,
    _LOGIT_BIAS,
    _NEUTRAL_BOOL,
    _TOKEN_IDS,
    OpenAIModel,
    StreamOptions,
    _schema,
)
from gateway.protocol.refused import REFUSED_ENGINE_SAMPLING, REFUSED_GENERATE, refuse_unsupported
from gateway.protocol.sampling import _STREAM_RULES, logit_bias_ids
from gateway.structured import build_constraint


class GenerateSamplingParams(OpenAIModel):
    """vLLM's SamplingParams as the generate endpoint takes them: engine field names and engine defaults
    (no generation_config.json overrides), every field the engine implements."""

    n: int = _schema(1, minimum=1, maximum=128)
    presence_penalty: float = _schema(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = _schema(0.0, minimum=-2, maximum=2)
    repetition_penalty: float = _schema(1.0, exclusiveMinimum=0)
    temperature: float = _schema(1.0, minimum=0, maximum=2)
    top_p: float = _schema(1.0, exclusiveMinimum=0, maximum=1)
    top_k: int = _schema(0, minimum=-1)
    min_p: float = _schema(0.0, minimum=0, maximum=1)
    seed: int | None = Field(default=None, **_I64)
    stop: str | list[str] | None = _schema(items={"minLength": 1}, minLength=1)
    stop_token_ids: list[int] | None = _schema(**_TOKEN_IDS)
    ignore_eos: bool = False
    # left out or null: the rest of the context (vLLM's server-side default)
    max_tokens: int | None = _schema(minimum=1)
    min_tokens: int = _schema(0, minimum=0)
    logprobs: int | None = _schema(minimum=-1)
    prompt_logprobs: int | None = _schema(minimum=-1)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = _schema(**_LOGIT_BIAS)
    bad_words: list[str] | None = _schema(**_BAD_WORDS)
    allowed_token_ids: list[int] | None = _schema(minItems=1, **_TOKEN_IDS)
    trace_decode_token_ids: list[int] | None = _schema(minItems=1, **_TOKEN_IDS)  # --enable-trace-replay only
    return_sampling_mass: bool = False  # beyond vLLM (docs/logprobs.md)
    routed_experts_prompt_start: StrictInt | None = _schema(minimum=0)  # routed experts from this prompt position on
    # vLLM fields that change nothing in a tokens-mode response
    output_kind: int | None = None  # JSON responses are whole; SSE streams deltas
    flat_logprobs: bool = False  # the engine's logprobs container; the JSON is the same
    stream_interval: int | None = Field(default=None, ge=1)
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    # vLLM fields rollbus refuses unless they ask for nothing (REFUSED_ENGINE_SAMPLING)
    watermarking: bool | None = _schema(**_NEUTRAL_BOOL)
    prompt_logprob_token_ids: list[int] | None = _schema(**_EMPTY_ARRAY)
    prompt_logprob_start: int | None = _schema(enum=[None])
    logprob_token_ids: list[int] | None = _schema(**_EMPTY_ARRAY)
    structured_outputs: dict[str, Any] | None = None  # as in chat and completions (gateway/structured.py)
    extra_args: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    skip_reading_prefix_cache: bool | None = _schema(**_NEUTRAL_BOOL)
    thinking_token_budget: int | None = _schema(enum=[None])
    repetition_detection: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        refuse_unsupported(self, REFUSED_ENGINE_SAMPLING, "sampling_params.")
        if self.logprobs is not None and self.logprobs < -1:
            raise ParamError("sampling_params.logprobs", "`logprobs` must be a positive value or -1.")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ParamError("sampling_params.stop", "stop cannot contain an empty string.")
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs,
            return_sampling_mass=self.return_sampling_mass, trace_decode_token_ids=self.trace_decode_token_ids,
            routed_experts_prompt_start=self.routed_experts_prompt_start or 0,
            structured_outputs=build_constraint(self.structured_outputs, None, {}, "sampling_params."),
            logit_bias=logit_bias_ids(self.logit_bias, "sampling_params.logit_bias"),
            allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []))


class GenerateRequest(OpenAIModel):
    """POST /inference/v1/generate in tokens mode (vLLM v0.33 `GenerateRequest`)."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {
        "stream_options": _STREAM_RULES["stream_options"],
        "stream": {"anyOf": [
            {"properties": {"stream": {"enum": [None, False]}}},
            {"properties": {"sampling_params": {"properties": {"prompt_logprobs": {"type": "null"}}}}}]},
    }})

    request_id: str | None = None
    token_ids: list[int] = Field(json_schema_extra={"minItems": 1, **_TOKEN_IDS})
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: str = _schema("tokens", enum=["tokens"])  # vLLM's text/derender modes are not offered here
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # see docs/openai-api.md
    priority: int = Field(default=0, **_I64)  # --scheduling-policy priority: lower first
    # what POST /v1/chat/completions/render puts in its output, read only by modes refused here
    token_offsets: list[tuple[int, int]] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    parse_context: dict[str, Any] | None = None
    # vLLM fields rollbus refuses unless they ask for nothing (REFUSED_GENERATE)
    features: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    content_parts: list[dict[str, Any]] | None = _schema(**_EMPTY_ARRAY)
    kv_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    ec_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)

    def check(self) -> None:
        refuse_unsupported(self, REFUSED_GENERATE)
        if self.output_mode != "tokens":
            raise ParamError("output_mode", f"`output_mode` {self.output_mode!r} is not supported by rollbus: only "
                                            "\"tokens\" is; decode the token ids on the client (POST /detokenize).")
        if not self.token_ids:
            raise ParamError("token_ids", "token_ids must contain at least one token")
        if any(t < 0 for t in self.token_ids):
            raise ParamError("token_ids", "token_ids must not contain negative values")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        p = self.sampling_params.prompt_logprobs
        if p is not None and p < -1:
            raise ParamError("sampling_params.prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.include_usage() and self.stream_options and self.stream_options.continuous_usage_stats)
