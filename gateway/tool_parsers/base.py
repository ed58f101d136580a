"""What every tool-call parser shares: the parsed call, the streamed delta, the per-stream state vLLM's
parsers keep, and vLLM's tool-call id (`chatcmpl-tool-<16 hex>`).

A parser is pure: text (and token ids) in, calls and deltas out; one instance per choice, since the
streaming methods keep state. `extract` reads a whole output; `extract_streaming` is called once per
delta with the text so far and returns what is new (None: nothing to send yet), never taking back
text it already sent.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """vLLM's id for a parsed call (random_uuid: 16 hex characters)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (text that may still become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=make_tool_call_id)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class DeltaToolCall:
    """One piece of a streamed call: the first carries id, type and name; later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        out["index"] = self.index
        fn: dict[str, Any] = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass
class Extracted:
    """A whole output's calls and the content beside them (None when there is none)."""

    calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@dataclass
class Delta:
    """What one streamed step adds to a message."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def empty(self) -> bool:
        return not self.content and not self.reasoning and not self.tool_calls


class ToolParser:
    """Base: the state vLLM's parsers keep per stream (what was sent of each call)."""

    name = ""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools or [])  # the request's tools, as the chat template sees them
        self.prev_calls: list[dict[str, Any]] = []  # per call: "name", "arguments" (text) as parsed so far
        self.streamed_args: list[str] = []  # per call: argument text already sent

    def tool_properties(self, name: str) -> dict[str, Any]:
        """The JSON Schema properties of the request's tool `name` ({} when it has none)."""
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties")
                return props if isinstance(props, dict) else {}
        return {}

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        """vLLM's `adjust_request`: tool-call markers may be special tokens, which must reach the parser."""
        return skip

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        raise NotImplementedError

    def unsent_content(self, text: str) -> str:
        """At the end of a stream: content held back as the possible start of a call marker."""
        return ""

    def remaining_arguments(self) -> str:
        """vLLM's get_remaining_unstreamed_args: argument text of the last call parsed but not yet sent."""
        if not self.prev_calls:
            return ""
        i = len(self.prev_calls) - 1
        args = self.prev_calls[i].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        sent = self.streamed_args[i] if i < len(self.streamed_args) else ""
        return expected[len(sent):] if expected.startswith(sent) else ""
