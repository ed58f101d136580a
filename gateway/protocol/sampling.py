"""The sampling fields of the request bodies, their checks, and how they become the engine's SamplingParams:
those /v1/completions and /v1/chat/completions share (OpenAI's plus vLLM's sampling extras), and the
sampling_params of /inference/v1/generate (vLLM's SamplingParams: engine field names and defaults)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictInt

from bus.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
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
from gateway.protocol.refused import REFUSED_ENGINE_SAMPLING, refuse_unsupported
from gateway.structured import GUIDED_ALIASES, build_constraint

# vLLM's defaults for fields a request leaves out (a model's generation_config.json may override them).
_FALLBACKS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                              "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                              "skip_special_tokens": True}


def logit_bias_ids(bias: dict[str, float] | None, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) as vLLM reads it: integer ids, each bias clamped to
    [-100, 100]; a key that is not an integer is a ParamError naming the field."""
    if not bias:
        return None
    out: dict[int, float] = {}
    bad = []
    for key, value in bias.items():
        try:
            out[int(key)] = min(100.0, max(-100.0, value))
        except ValueError:
            bad.append(key)
    if bad:
        raise ParamError(param, f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
    return out


# Rules between fields, in the published schema (JSON Schema's dependentSchemas: when the named field is
# present, the object must also match): the checks that enforce them are _check_common and the `check`s.
_STREAM_RULES: dict[str, Any] = {
    "stream_options": {"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                                 {"properties": {"stream": {"const": True}}, "required": ["stream"]}]},
    "prompt_logprobs": {"anyOf": [{"properties": {"prompt_logprobs": {"enum": [None, 0]}}},
                                  {"properties": {"stream": {"enum": [None, False]}}}]},
}


class _SamplingRequest(OpenAIModel):
    """Fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": _STREAM_RULES})

    model: str | None = None
    n: int = _schema(1, minimum=1, maximum=128)
    seed: int | None = Field(default=None, **_I64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = _schema(items={"minLength": 1}, minLength=1)
    temperature: float | None = _schema(minimum=0, maximum=2)
    top_p: float | None = _schema(exclusiveMinimum=0, maximum=1)
    presence_penalty: float | None = _schema(minimum=-2, maximum=2)
    frequency_penalty: float | None = _schema(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = _schema(**_LOGIT_BIAS)
    user: str | None = None
    # vLLM extras
    top_k: int | None = _schema(minimum=-1)
    min_p: float | None = _schema(minimum=0, maximum=1)
    repetition_penalty: float | None = _schema(exclusiveMinimum=0)
    min_tokens: int = _schema(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = _schema(**_TOKEN_IDS)
    allowed_token_ids: list[int] | None = _schema(minItems=1, **_TOKEN_IDS)
    bad_words: list[str] | None = _schema(**_BAD_WORDS)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool | None = None  # vLLM v0.33: per-choice weight_versions spans
    prompt_logprobs: int | None = _schema(minimum=-1)
    return_sampling_mass: bool | None = None  # beyond vLLM: per-token kept mass (docs/logprobs.md)
    routed_experts_prompt_start: StrictInt | None = _schema(minimum=0)  # routed experts from this prompt position on
    skip_special_tokens: bool | None = None  # null: the generation defaults' value (True unless configured)
    spaces_between_special_tokens: bool = True  # fast tokenizers ignore it, in vLLM too
    truncation_side: Literal["left", "right"] | None = None  # null: left (keep the last tokens), as vLLM
    session_id: str | None = None  # routing identity; no effect on the output
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # see docs/openai-api.md
    return_token_offsets: bool | None = False  # vLLM: only the render endpoints return offsets
    mm_payload: Literal["tensors", "none"] = "tensors"  # render-only; no multimodal items here
    return_mm_kwargs: bool | None = None  # deprecated alias of mm_payload
    stream_interval: int | None = Field(default=None, ge=1)  # chunking only: tokens are sent as they come
    # vLLM fields rollbus refuses unless they ask for nothing (REFUSED_SAMPLING)
    use_beam_search: bool = _schema(False, **_NEUTRAL_BOOL)
    length_penalty: float = _schema(1.0, enum=[None, 1.0])
    watermarking: bool | None = _schema(**_NEUTRAL_BOOL)
    logprob_token_ids: list[int] | None = _schema(**_EMPTY_ARRAY)
    thinking_token_budget: int | None = _schema(enum=[None])
    repetition_detection: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    kv_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    ec_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    vllm_xargs: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    priority: int = Field(default=0, **_I64)  # --scheduling-policy priority: lower first
    best_of: int | None = _schema(enum=[None, 1])
    # structured outputs (gateway/structured.py; docs/structured-outputs.md)
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = _schema(
        anyOf=[{"type": "null"}, {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}}, "required": ["type"]}])
    # vLLM v0.33 removed these (it ignores them); accepted here as aliases of structured_outputs' fields
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_decoding_backend: str | None = _schema(enum=[None, "auto", "guidance", "llguidance"])
    guided_whitespace_pattern: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.include_usage() and self.stream_options and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        if any(not s for s in self.stop_list()):
            raise ParamError("stop", "stop cannot contain an empty string.")
        check_prompt_logprobs(self.prompt_logprobs, bool(self.stream))

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  defaults: dict[str, Any] | None, prompt_logprobs: int | None = None) -> SamplingParams:
        d = {**_FALLBACKS, **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return d[name] if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            min_p=pick("min_p"), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"), logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=pick("skip_special_tokens"), prompt_logprobs=prompt_logprobs,
            return_sampling_mass=bool(self.return_sampling_mass), trace_decode_token_ids=self.trace_tokens(),
            routed_experts_prompt_start=self.routed_experts_prompt_start or 0, cache_salt=self.cache_salt,
            structured_outputs=self.constraint(), logit_bias=logit_bias_ids(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []),
            priority=self.priority or 0)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint the request asks for (gateway/structured.py)."""
        return build_constraint(self.structured_outputs, self.response_format,
                                {k: getattr(self, k) for k in (*GUIDED_ALIASES, "guided_decoding_backend")})

    def trace_tokens(self) -> list[int] | None:
        """vllm_xargs.trace_decode_token_ids: trace replay on the OpenAI endpoints (beyond vLLM, whose
        OpenAI endpoints have no trace field; the server's --enable-trace-replay still decides)."""
        trace = (self.vllm_xargs or {}).get("trace_decode_token_ids")
        if trace is None:
            return None
        if not isinstance(trace, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in trace):
            raise ParamError("vllm_xargs.trace_decode_token_ids", "trace_decode_token_ids must be a list of integers.")
        return trace


def check_prompt_logprobs(value: int | None, stream: bool) -> None:
    """vLLM's request-level checks (completion and chat protocol `check_logprobs`)."""
    if value is None:
        return
    if stream and (value > 0 or value == -1):
        raise ParamError("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    if value < -1:
        raise ParamError("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")


# --- /inference/v1/generate's sampling_params -----------------------------------------------------


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
