"""Request bodies of /v1/completions, /v1/chat/completions and /inference/v1/generate, as vLLM accepts them.

Field names, types and defaults are vLLM's (OpenAI's fields plus vLLM's sampling extras), so clients
port unchanged. Unknown fields are ignored with a log line, as vLLM does. Checks that span several
fields raise ParamError (naming the field), which the gateway reports as a 400 with `param` set.

Every field of vLLM v0.33's schemas is declared here with vLLM's type, so none is dropped unread: a
field rollbus does not implement is refused (400 naming it) when its value asks for something, through
the `Refuse` tables below (docs/openai-api.md lists them); a value that asks for nothing (the default,
null, an empty list) is accepted. Structured outputs (`structured_outputs`, `response_format`, and the
`guided_*` fields vLLM v0.33 removed, accepted here as aliases) become one constraint in
gateway/structured.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import structlog
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from bus.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from engine.structured_outputs import check_json_schema, tool_choice_schema
from gateway.structured import GUIDED_ALIASES, build_constraint, forced_tool_constraint

log = structlog.get_logger()

_I64: dict[str, int] = {"ge": -(2**63), "le": 2**63 - 1}
# vLLM's defaults for fields a request leaves out (a model's generation_config.json may override them).
_FALLBACKS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                              "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                              "skip_special_tokens": True}

Prompt = str | list[str] | list[int] | list[list[int]]


def _schema(default: Any = None, **schema: Any) -> Any:
    """A field whose published JSON schema (/openapi.json) states the values vLLM's checks accept, so a
    schema-driven client or fuzzer knows them; the checks themselves stay where they are (SamplingParams,
    the `check` methods, the Refuse tables), with vLLM's messages. Numeric, string and array keywords apply
    only to values of their type, so they sit beside an `anyOf` with null."""
    return Field(default, json_schema_extra=schema)


_NEUTRAL_BOOL = {"enum": [None, False]}  # a refused feature's switch: only "off" is served
_EMPTY_OBJECT = {"maxProperties": 0}
_EMPTY_ARRAY = {"maxItems": 0}
_TOKEN_IDS = {"items": {"minimum": 0}}  # the gateway's /openapi.json adds the vocabulary's maximum
_LOGIT_BIAS = {"propertyNames": {"pattern": "^[0-9]{1,9}$"}}  # token id -> bias (clamped to [-100, 100])
_BAD_WORDS = {"items": {"minLength": 1, "pattern": "[^ ]"}}  # a word of only spaces tokenizes to nothing


# --- fields of vLLM's schemas that rollbus does not implement ----------------------------------


class Refuse(NamedTuple):
    """A vLLM field rollbus does not implement: `neutral(value)` says the value asks for nothing."""

    neutral: Callable[[Any], bool]
    why: str


def _unset(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v == default


def _trace_only(v: Any) -> bool:
    """vllm_xargs asks for nothing rollbus lacks when it holds at most trace_decode_token_ids."""
    return _unset(v) or (isinstance(v, dict) and set(v) <= {"trace_decode_token_ids"})


_MULTIMODAL = "rollbus serves text-only models"
_DISAGG = "disaggregated serving (KV/EC transfer) is not supported"

# Shared by /v1/completions and /v1/chat/completions (vLLM v0.33 field names).
REFUSED_SAMPLING: dict[str, Refuse] = {
    "use_beam_search": Refuse(_unset, "beam search is not supported"),
    "length_penalty": Refuse(_equals(1.0), "it only applies to beam search, which is not supported"),
    "watermarking": Refuse(_unset, "watermarking is not supported"),
    "logprob_token_ids": Refuse(_unset, "logprobs of chosen token ids are not supported; use logprobs"),
    "thinking_token_budget": Refuse(_unset, "thinking token budgets are not supported"),
    "repetition_detection": Refuse(_unset, "repetition detection is not supported"),
    "kv_transfer_params": Refuse(_unset, _DISAGG),
    "ec_transfer_params": Refuse(_unset, _DISAGG),
    "vllm_xargs": Refuse(_trace_only, "custom sampling extensions are not supported; the one key served is "
                                      "trace_decode_token_ids (trace replay, with --enable-trace-replay)"),
    "best_of": Refuse(_equals(1), "removed from vLLM; use n"),
}
REFUSED_COMPLETION: dict[str, Refuse] = {
    **REFUSED_SAMPLING,
    "suffix": Refuse(_unset, "suffix is not currently supported"),
    "prompt_embeds": Refuse(_unset, "prompt embeddings are not supported"),
}
REFUSED_CHAT: dict[str, Refuse] = {
    **REFUSED_SAMPLING,
    "echo": Refuse(_unset, "echoing the last message into the response is not supported yet"),
    "return_prompt_text": Refuse(_unset, "returning the rendered prompt is not supported yet; "
                                         "use POST /v1/chat/completions/render"),
    "media_io_kwargs": Refuse(_unset, _MULTIMODAL),
    "mm_processor_kwargs": Refuse(_unset, _MULTIMODAL),
}
# POST /inference/v1/generate: the request and its sampling_params (vLLM's SamplingParams).
REFUSED_GENERATE: dict[str, Refuse] = {
    "features": Refuse(_unset, _MULTIMODAL),
    "content_parts": Refuse(_unset, _MULTIMODAL),
    "kv_transfer_params": Refuse(_unset, _DISAGG),
    "ec_transfer_params": Refuse(_unset, _DISAGG),
}
REFUSED_ENGINE_SAMPLING: dict[str, Refuse] = {
    "watermarking": Refuse(_unset, "watermarking is not supported"),
    "prompt_logprob_token_ids": Refuse(_unset, "prompt logprobs of chosen token ids are not supported"),
    "prompt_logprob_start": Refuse(_unset, "prompt logprobs from a start position are not supported"),
    "logprob_token_ids": Refuse(_unset, "logprobs of chosen token ids are not supported; use logprobs"),
    "extra_args": Refuse(_unset, "custom sampling extensions are not supported"),
    "skip_reading_prefix_cache": Refuse(_unset, "every request may read the prefix cache here"),
    "thinking_token_budget": Refuse(_unset, "thinking token budgets are not supported"),
    "repetition_detection": Refuse(_unset, "repetition detection is not supported"),
}


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


def refuse_unsupported(model: BaseModel, table: dict[str, Refuse], prefix: str = "") -> None:
    """400 (ParamError naming the field) for a field the request set to something rollbus cannot do."""
    for name in model.model_fields_set:
        rule = table.get(name)
        if rule is not None and not rule.neutral(getattr(model, name)):
            raise ParamError(prefix + name, f"`{prefix}{name}` is not supported by rollbus: {rule.why}.")


class OpenAIModel(BaseModel):
    """Base: ignore unknown fields like vLLM, but say which ones were ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                log.info("gateway.ignored_fields", model=cls.__name__, fields=sorted(unknown)[:20])
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Rules between fields, in the published schema (JSON Schema's dependentSchemas: when the named field is
# present, the object must also match): the checks that enforce them are _check_common and the `check`s.
_STREAM_RULES: dict[str, Any] = {
    "stream_options": {"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                                 {"properties": {"stream": {"const": True}}, "required": ["stream"]}]},
    "prompt_logprobs": {"anyOf": [{"properties": {"prompt_logprobs": {"enum": [None, 0]}}},
                                  {"properties": {"stream": {"enum": [None, False]}}}]},
}
_CHAT_RULES: dict[str, Any] = {
    **_STREAM_RULES,
    "top_logprobs": {"anyOf": [{"properties": {"top_logprobs": {"enum": [None, 0]}}},
                               {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]},
    "continue_final_message": {"anyOf": [{"properties": {"continue_final_message": {"const": False}}},
                                         {"properties": {"add_generation_prompt": {"const": False}},
                                          "required": ["add_generation_prompt"]}]},
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


# --- /v1/completions -----------------------------------------------------------------------------


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


# --- /v1/chat/completions ------------------------------------------------------------------------


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (reasoning_content, ...) are kept, since templates may read them."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM joins text parts with newlines

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template sees: content as one string, tool-call arguments as objects."""
        msg: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        msg["role"], msg["content"] = self.role, self.text()
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [_parse_arguments(tc) for tc in self.tool_calls]
        return msg


def _parse_arguments(tool_call: dict[str, Any]) -> dict[str, Any]:
    """Templates iterate over arguments as a mapping; OpenAI sends them as a JSON string (vLLM parses)."""
    fn = tool_call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**tool_call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            return tool_call
    return tool_call


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def check(self, param: str) -> None:
        """`parameters` must be a JSON Schema (vLLM hands it to the template and the grammar engine)."""
        if self.parameters is not None:
            check_json_schema(self.parameters, f"{param}.parameters")


_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _named_choice(choice: dict[str, Any]) -> str:
    """vLLM's checks of a named tool_choice; returns the name."""
    function = choice.get("function")
    if not isinstance(function, dict):
        raise ParamError("tool_choice.function", f"Invalid value for `function`: `{function}` in `tool_choice`! "
                                                 f"{_CHOICE_USAGE}")
    if "name" not in function:
        raise ParamError("tool_choice.function.name", f"Expected field `name` in `function` in `tool_choice`! "
                                                      f"{_CHOICE_USAGE}")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ParamError("tool_choice.function.name", f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                                                      f"{_CHOICE_USAGE}")
    return name


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"dependentSchemas": _CHAT_RULES})

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: int | None = _schema(minimum=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = _schema(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = _schema(0, minimum=-1)
    tools: list[Tool] | None = _schema(minItems=1)
    # "none", "auto" (needs --enable-auto-tool-choice: gateway/serving_chat.py), "required" / a named function
    # (forced by a grammar: gateway/forced_tools.py); see _check_tools
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = _schema(
        "none", anyOf=[{"enum": ["none", "auto", "required", None]}, {"type": "object", "required": ["function"]}])
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # given to the chat template, as vLLM
    reasoning_effort: str | None = None  # given to the chat template (and enable_thinking), as vLLM
    # vLLM fields rollbus refuses unless they ask for nothing (REFUSED_CHAT)
    include_reasoning: bool = True  # False: no reasoning in the response (with --reasoning-parser)
    echo: bool = _schema(False, **_NEUTRAL_BOOL)
    return_prompt_text: bool | None = _schema(**_NEUTRAL_BOOL)
    media_io_kwargs: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    mm_processor_kwargs: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)

    def max_tokens_param(self) -> str:
        """Which field the user set, so errors name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
        refuse_unsupported(self, REFUSED_CHAT)
        self._check_tools()
        self._check_common()
        if self.top_logprobs is not None:
            if self.top_logprobs < -1:
                raise ParamError("top_logprobs", "`top_logprobs` must be a positive value or -1.")
            if (self.top_logprobs > 0 or self.top_logprobs == -1) and not self.logprobs:
                raise ParamError("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message", "Cannot set both `continue_final_message` and "
                                                       "`add_generation_prompt` to True.")
        if self.continue_final_message and (not self.messages or self.messages[-1].role != "assistant"):
            raise ParamError("continue_final_message",
                             "continue_final_message needs a final assistant message to continue")

    def tool_choice_value(self) -> Any:
        """vLLM: tool_choice left out means "auto" with tools, "none" without."""
        if "tool_choice" in self.model_fields_set:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def _check_tools(self) -> None:
        """vLLM's checks of tools and tool_choice (every tool's parameters a JSON Schema, a named function one of
        them). "none" renders the tools and parses nothing; "auto" is checked against the server's flags by the
        chat handler; "required" and named functions are forced by a grammar (constraint())."""
        if self.tools == []:
            raise ParamError("tools", "`tools` must not be an empty array. Either provide at least one tool or "
                                      "omit the field entirely.")
        for i, tool in enumerate(self.tools or []):
            tool.function.check(f"tools.{i}.function")
        choice = self.tool_choice_value()
        if choice in (None, "none", "auto") and (choice != "auto" or self.tools):
            return
        if not self.tools:
            raise ParamError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, dict):
            name = _named_choice(choice)
            if all(t.function.name != name for t in self.tools):
                raise ParamError("tool_choice", "The tool specified in `tool_choice` does not match any of the "
                                                "specified `tools`")

    def forced_tool(self) -> bool:
        """tool_choice "required" or a named function: the output is forced into tool calls."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def constraint(self) -> StructuredOutputsParams | None:
        """A forced tool choice replaces structured_outputs and response_format with the tools' schema
        (vLLM); a named function together with structured_outputs is refused, as vLLM does."""
        if not self.forced_tool():
            return super().constraint()
        if isinstance(self.tool_choice, dict) and self.structured_outputs and any(
                self.structured_outputs.get(k) is not None for k in ("json", "regex", "choice")):
            raise ParamError("structured_outputs", "You can only either use constraints for structured outputs or "
                                                   "tools, not both.")
        schema = tool_choice_schema(self.template_tools() or [], self.tool_choice, self.parallel_tool_calls)
        return forced_tool_constraint(schema, self.structured_outputs,
                                      {"guided_whitespace_pattern": self.guided_whitespace_pattern})

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template sees beyond messages and tools (vLLM's ChatParams)."""
        user = dict(self.chat_template_kwargs or {})
        extra: dict[str, Any] = {}
        if self.documents is not None:
            extra["documents"] = self.documents
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
            if "enable_thinking" not in user:
                extra["enable_thinking"] = self.reasoning_effort != "none"
        return {**extra, **user}

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of the conversation; default_max_tokens (the rest of the context) fills a gap."""
        self.check()
        requested = self.requested_max_tokens()
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults, self.prompt_logprobs)


# --- /inference/v1/generate (tokens in, tokens out) ----------------------------------------------


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
