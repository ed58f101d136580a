"""The request body of POST /v1/responses (vLLM v0.33's `ResponsesRequest`) and its input items, and how a
request becomes the chat request the chat machinery runs (gateway/serving_chat.py: template, tool and
reasoning parsers, forced tool calls, structured outputs).

Input items are checked one by one, so a bad one is a 400 naming it (`input.3.type`, `input.0.content.1`):
messages (`input_text` parts; an assistant's `output_text` / `refusal`), `function_call`,
`function_call_output` and `reasoning` items. Every other item type, and every field of vLLM's (and OpenAI's)
schema that rollbus does not implement, is refused with a 400 naming it when its value asks for something.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bus.sampling_params import ParamError
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.fields import _I64, _LOGIT_BIAS, _NEUTRAL_BOOL, OpenAIModel, _schema
from gateway.protocol.refused import Refuse, _unset, refuse_unsupported

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_ONLY = "rollbus serves text-only models"
REFUSED_RESPONSES: dict[str, Refuse] = {
    "max_tool_calls": Refuse(_unset, "it limits built-in tool calls, and rollbus runs no built-in tools"),
    "prompt": Refuse(_unset, "prompt template is not supported"),  # vLLM's words
    "mm_processor_kwargs": Refuse(_unset, _TEXT_ONLY),
    "enable_response_messages": Refuse(_unset, "returning the raw input and output messages is not supported"),
    "previous_input_messages": Refuse(_unset, "it carries Harmony (gpt-oss) messages, which rollbus does not render"),
    "previous_response": Refuse(_unset, "stateless multi-turn needs encrypted reasoning, which rollbus does not "
                                        "produce; use previous_response_id or send the items in `input`"),
    "conversation": Refuse(_unset, "conversations are not stored; use previous_response_id"),
    "context_management": Refuse(_unset, "server-side context compaction is not implemented"),
}


class _Item(BaseModel):
    """An input item: OpenAI's output fields that change nothing in the prompt (status, annotations) are
    accepted and dropped."""

    model_config = ConfigDict(extra="ignore")


class TextContent(_Item):
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None  # a refusal part's text

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/components/schemas/TextContent"}}]}


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]] = Field(json_schema_extra=_PARTS)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]] = Field(json_schema_extra=_PARTS)
    id: str | None = None
    status: str | None = None


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = _schema(enum=[None])
    status: str | None = None


INPUT_ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                       "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(_Item):
    """A function tool as the Responses API defines it (flat, unlike chat's {"function": {...}})."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# the schemas /openapi.json publishes for `input` items and `tools` (the fields are read item by item)
SCHEMA_MODELS: tuple[type[BaseModel], ...] = (TextContent, *INPUT_ITEMS.values(), FunctionTool)


def _parse(model: type[BaseModel], value: Any, param: str) -> Any:
    """Validate one item; a ValidationError becomes a 400 naming the item's field."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([param, *(str(p) for p in first["loc"] if not str(p).startswith(("str", "list[")))])
        raise ParamError(where, f"{where}: {first['msg']}") from None


def _text_parts(parts: str | list[dict[str, Any]], param: str) -> str:
    """Content as text: a string, or text parts joined with newlines (as chat content parts are)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ParamError(f"{param}.{j}.type", f"Content type {kind!r} is not supported by rollbus: {_TEXT_ONLY}.")
        if kind not in ("input_text", "output_text", "refusal"):
            raise ParamError(f"{param}.{j}.type", f"Content type {kind!r} is not supported by rollbus: a message's "
                                                  "content parts are input_text (output_text or refusal for an "
                                                  "assistant).")
        texts.append(_parse(TextContent, part, f"{param}.{j}").value())
    return "\n".join(texts)


def item_type(item: Any) -> str | None:
    """An item's type; OpenAI's "easy" message ({"role", "content"}) has none."""
    if not isinstance(item, dict):
        return None
    return item.get("type", "message" if "role" in item else None)


def items_to_messages(items: list[Any], param: str = "input") -> list[dict[str, Any]]:
    """Response items (input, or a stored response's output) -> chat messages. An assistant's reasoning,
    text and function calls in a row become one assistant message, as a chat template expects them."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        where = f"{param}.{i}"
        kind = item_type(raw)
        model = INPUT_ITEMS.get(kind or "")
        if model is None:
            if not isinstance(raw, dict):
                raise ParamError(where, f"{where} must be an object (an input item)")
            raise ParamError(f"{where}.type", f"Input item type {kind!r} is not supported by rollbus: the items served "
                                              f"are {', '.join(INPUT_ITEMS)}.")
        item = _parse(model, raw, where)
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            text = _text_parts(item.content, f"{where}.content")
            if item.role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = text
            else:
                out.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text_parts(item.output, f"{where}.output")})
        else:
            assert isinstance(item, ReasoningItem)
            if item.encrypted_content is not None:
                raise ParamError(f"{where}.encrypted_content", "Encrypted content is not supported.")  # vLLM's words
            text = "".join(p.text for p in (item.content or item.summary))
            if last is not None and last.get("reasoning") is None and last.get("content") is None and \
                    not last.get("tool_calls"):
                last["reasoning"] = last["reasoning_content"] = text
            else:  # templates read reasoning_content (Qwen3); vLLM's own key is reasoning
                out.append({"role": "assistant", "content": None, "reasoning": text, "reasoning_content": text})
    return out


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = _schema(enum=[None])


class ReasoningConfig(OpenAIModel):
    effort: str | None = None
    summary: str | None = _schema(enum=[None])
    generate_summary: str | None = _schema(enum=[None])


class StreamOptions(OpenAIModel):
    include_obfuscation: bool | None = _schema(**_NEUTRAL_BOOL)


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses (vLLM v0.33's fields, plus OpenAI's newer ones, refused by name)."""

    background: bool | None = False
    include: list[str] | None = _schema(items={"enum": [LOGPROBS_INCLUDE]})
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = _schema(minimum=1)
    max_tool_calls: int | None = _schema(enum=[None])
    metadata: dict[str, str] | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = _schema(**_LOGIT_BIAS)  # as chat's (docs/openai-api.md)
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = _schema(enum=[None])
    reasoning: ReasoningConfig | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"  # echoed, as vLLM
    store: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = _schema(minimum=0, maximum=2)
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = _schema(
        "auto", anyOf=[{"enum": ["none", "auto", "required"]},
                       {"type": "object", "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                        "required": ["type", "name"]}])
    tools: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={
        "items": {"$ref": "#/components/schemas/FunctionTool"}})
    top_logprobs: int | None = _schema(0, minimum=0, maximum=20)
    top_p: float | None = _schema(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _schema(minimum=-1)
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of user: changes nothing here either
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache needs none (vLLM ignores it too)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM extras
    request_id: str | None = Field(default=None, min_length=1)  # the response's id (default resp_<hex>)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    structured_outputs: dict[str, Any] | None = None
    repetition_penalty: float | None = _schema(exclusiveMinimum=0)
    seed: int | None = Field(default=None, **_I64)
    stop: str | list[str] | None = _schema(items={"minLength": 1}, minLength=1)
    ignore_eos: bool = False
    priority: int = Field(default=0, **_I64)  # --scheduling-policy priority: lower first (as chat's)
    vllm_xargs: dict[str, Any] | None = None  # trace_decode_token_ids only (as chat)
    # refused unless they ask for nothing (REFUSED_RESPONSES)
    mm_processor_kwargs: dict[str, Any] | None = _schema(maxProperties=0)
    enable_response_messages: bool = _schema(False, **_NEUTRAL_BOOL)
    previous_input_messages: list[Any] | None = _schema(maxItems=0)
    previous_response: dict[str, Any] | None = _schema(enum=[None])
    conversation: str | dict[str, Any] | None = _schema(enum=[None])
    context_management: list[Any] | None = _schema(maxItems=0)

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {
        "background": {"anyOf": [{"properties": {"background": {"enum": [None, False]}}},
                                 {"properties": {"store": {"enum": [None, True]}}}]},
        "stream_options": {"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                                     {"properties": {"stream": {"const": True}}, "required": ["stream"]}]}}})

    def check(self) -> None:
        """Checks across fields (vLLM's words where it has them); raises ParamError naming the field."""
        refuse_unsupported(self, REFUSED_RESPONSES)
        if self.background and self.store is False:
            raise ParamError("background", "background can only be used when `store` is true")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ParamError("stream_options.include_obfuscation", "`stream_options.include_obfuscation` is not "
                                                                   "supported by rollbus: events carry no padding.")
        for i, value in enumerate(self.include or []):
            if value != LOGPROBS_INCLUDE:
                raise ParamError(f"include.{i}", f"`include` value {value!r} is not supported by rollbus: the one "
                                                 f"served is {LOGPROBS_INCLUDE!r}.")
        for name in ("summary", "generate_summary"):
            if self.reasoning is not None and getattr(self.reasoning, name) is not None:
                raise ParamError(f"reasoning.{name}", f"`reasoning.{name}` is not supported by rollbus: reasoning is "
                                                      "returned as reasoning_text content, never summarised.")
        if self.text is not None and self.text.verbosity is not None:
            raise ParamError("text.verbosity", "`text.verbosity` is not supported by rollbus.")
        if isinstance(self.input, list) and not self.input:
            raise ParamError("input", "`input` must hold at least one item")

    def logprobs(self) -> bool:
        """Output logprobs: asked for with include (vLLM), or by a positive top_logprobs."""
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (its instructions are not part of it: they do not carry
        over to a later response)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        tools = []
        for i, raw in enumerate(self.tools):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind != "function":
                raise ParamError(f"tools.{i}.type", f"Tool type {kind!r} is not supported by rollbus: only function "
                                                    "tools are (rollbus runs no built-in tools).")
            tool = _parse(FunctionTool, raw, f"tools.{i}")
            tools.append({"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)})
        return tools or None

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function":
            raise ParamError("tool_choice.type", f"tool_choice type {choice.get('type')!r} is not supported by "
                                                 "rollbus: use none, auto, required or {\"type\": \"function\", "
                                                 "\"name\": ...}.")
        return {"type": "function", "function": {"name": choice.get("name")}}

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                       "strict": fmt.strict}}

    def to_chat(self, messages: list[dict[str, Any]], max_model_len: int) -> ChatCompletionRequest:
        """The chat request this response runs as: `messages` (the history and this input), with the
        instructions first, and the sampling fields. max_tokens is left to the context (the handler caps it
        at max_output_tokens, as vLLM does)."""
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        tools = self.chat_tools()
        body: dict[str, Any] = {
            "messages": messages, "tools": tools, "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop": self.stop or None, "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": self.logprobs(), "top_logprobs": self.top_logprobs or 0, "cache_salt": self.cache_salt,
            "vllm_xargs": self.vllm_xargs, "structured_outputs": self.structured_outputs,
            "logit_bias": self.logit_bias, "priority": self.priority,
            "response_format": self.response_format()}
        if tools:
            body["tool_choice"] = self.chat_tool_choice()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.truncation == "auto":  # keep the prompt's last tokens that leave room for the output
            body["truncate_prompt_tokens"] = max(1, max_model_len - (self.max_output_tokens or 1))
        if self.structured_outputs is not None and body["response_format"] is not None:
            raise ParamError("text.format", "Cannot specify both structured_outputs and text.format")  # vLLM's words
        return ChatCompletionRequest.model_validate(body)


# chat field -> the Responses field a client set (errors of the chat machinery name what the client sent)
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "logprobs": "top_logprobs", "tool_choice.function": "tool_choice",
           "tool_choice.function.name": "tool_choice.name"}


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat request's field in an error (`tools.0.function.parameters` ->
    `tools.0.parameters`)."""
    if param is None:
        return None
    if param in _PARAMS:
        return _PARAMS[param]
    parts = param.split(".")
    if len(parts) > 2 and parts[0] == "tools" and parts[2] == "function":
        return ".".join(parts[:2] + parts[3:])
    if parts[0] == "response_format":
        return "text.format." + ".".join(parts[1:])
    return param
