"""POST /v1/chat/completions: the request body (messages, tools and tool_choice, the chat template's inputs),
as vLLM accepts it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bus.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from engine.structured_outputs import check_json_schema, tool_choice_schema
from gateway.protocol.fields import _EMPTY_OBJECT, _NEUTRAL_BOOL, OpenAIModel, _schema
from gateway.protocol.refused import REFUSED_CHAT, refuse_unsupported
from gateway.protocol.sampling import _STREAM_RULES, _SamplingRequest
from gateway.structured import forced_tool_constraint

_CHAT_RULES: dict[str, Any] = {
    **_STREAM_RULES,
    "top_logprobs": {"anyOf": [{"properties": {"top_logprobs": {"enum": [None, 0]}}},
                               {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]},
    "continue_final_message": {"anyOf": [{"properties": {"continue_final_message": {"const": False}}},
                                         {"properties": {"add_generation_prompt": {"const": False}},
                                          "required": ["add_generation_prompt"]}]},
}


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
