"""Request bodies of /v1/completions, /v1/chat/completions and /inference/v1/generate, as vLLM accepts them.

Field names, types and defaults are vLLM's (OpenAI's fields plus vLLM's sampling extras), so clients
port unchanged. Unknown fields are ignored with a log line, as vLLM does. Checks that span several
fields raise ParamError (naming the field), which the gateway reports as a 400 with `param` set.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from engine.sampling_params import ParamError, SamplingParams

log = structlog.get_logger()

_I64: dict[str, int] = {"ge": -(2**63), "le": 2**63 - 1}
# vLLM's defaults for fields a request leaves out (a model's generation_config.json may override them).
_FALLBACKS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                              "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                              "skip_special_tokens": True}

Prompt = str | list[str] | list[int] | list[list[int]]


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


class _SamplingRequest(OpenAIModel):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = 1
    seed: int | None = Field(default=None, **_I64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool | None = None  # vLLM v0.33: per-choice weight_versions spans
    prompt_logprobs: int | None = None
    return_sampling_mass: bool | None = None  # beyond vLLM: per-token kept mass (docs/logprobs.md)
    routed_experts_prompt_start: StrictInt | None = None  # routed experts from this prompt position on (vLLM)

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
        if self.logit_bias:
            raise ParamError("logit_bias", "logit_bias is not supported by rollbus")
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
            return_sampling_mass=bool(self.return_sampling_mass),
            routed_experts_prompt_start=self.routed_experts_prompt_start or 0)


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
    prompt: Prompt
    max_tokens: int | None = 16  # vLLM and OpenAI: 16; explicit null means "the rest of the context"
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True

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
        self._check_common()
        if self.suffix is not None:
            raise ParamError("suffix", "suffix is not currently supported")
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


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def max_tokens_param(self) -> str:
        """Which field the user set, so errors name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
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

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(default=None, **_I64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None  # left out or null: the rest of the context (vLLM's server-side default)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    trace_decode_token_ids: list[int] | None = None
    return_sampling_mass: bool = False  # beyond vLLM (docs/logprobs.md)
    routed_experts_prompt_start: StrictInt | None = None  # routed experts from this prompt position on (vLLM)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        for name in ("logit_bias", "bad_words", "allowed_token_ids"):
            if getattr(self, name):
                raise ParamError(f"sampling_params.{name}", f"{name} is not supported by rollbus")
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
            routed_experts_prompt_start=self.routed_experts_prompt_start or 0)


class GenerateRequest(OpenAIModel):
    """POST /inference/v1/generate in tokens mode (vLLM v0.33 `GenerateRequest`)."""

    request_id: str | None = None
    token_ids: list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"  # vLLM's text/derender modes are not offered here
    cache_salt: str | None = None  # accepted; the prefix cache is per engine and unsalted
    priority: int = 0

    def check(self) -> None:
        if not self.token_ids:
            raise ParamError("token_ids", "token_ids must contain at least one token")
        if any(t < 0 for t in self.token_ids):
            raise ParamError("token_ids", "token_ids must not contain negative values")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        p = self.sampling_params.prompt_logprobs
        if p is not None and p < -1:
            raise ParamError("sampling_params.prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")
        if self.priority != 0:
            raise ParamError("priority", "priority scheduling is not enabled: priority must be 0")

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.include_usage() and self.stream_options and self.stream_options.continuous_usage_stats)
