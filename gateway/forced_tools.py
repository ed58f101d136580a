"""`tool_choice: "required"` and a named function: the output the grammar forced, as OpenAI `tool_calls`.

The constraint (engine.structured_outputs.tool_choice_schema) makes the output, as in vLLM:
  named     the function's arguments object: one call of that function with this text as its arguments;
  required  a JSON array of {"name": ..., "parameters": {...}}: one call per item, the arguments being
            the parameters re-serialised (json.dumps, non-ASCII kept), as vLLM does.
Streaming sends each call's id, type and name in its first delta, then its arguments text as it grows
(never taking any back). finish_reason is vLLM's: "tool_calls" when calls were made and the model stopped,
except for a named function (OpenAI reports "stop" there); "length" stays "length".

An output cut by max_tokens is returned as far as it goes, as vLLM returns any partial content (and as the
stream sends it): the calls whose name is complete, the last one with its arguments text cut where the
output stops (vLLM's "required" path returns no message at all there). An output cut before any call's
name is complete is returned as `content`, so a finished choice is never an empty message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.tool_parsers.base import ToolCall, make_tool_call_id


def _named(tool_choice: Any) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def forced_tool_calls(tool_choice: Any, text: str) -> list[dict[str, Any]]:
    """The calls in a whole forced output; a cut one gives its partial calls (none when it is empty)."""
    name = _named(tool_choice)
    if name is not None:
        if not text.strip():
            return []
        return [_call(name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return _partial_calls(text)
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return []
        calls.append(_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def _partial_calls(text: str) -> list[dict[str, Any]]:
    """The calls of an unfinished "required" array: every item whose name is complete, with its arguments
    text as far as the output goes (what the stream sent for it)."""
    calls = []
    for span in _scan(text, []):
        if span.name is None:
            break
        args = "" if span.args_start is None else \
            text[span.args_start:span.args_end if span.args_end is not None else len(text)]
        calls.append(_call(span.name, args))
    return calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return ToolCall(name, arguments).to_json()  # the parsed calls' shape and id (gateway/tool_parsers/base.py)


def finish_reason(engine_reason: str | None, tool_choice: Any, calls_made: bool) -> str | None:
    if engine_reason is None:
        return None
    if calls_made and engine_reason == "stop" and _named(tool_choice) is None:
        return "tool_calls"
    return engine_reason


@dataclass(slots=True)
class _Span:
    """One item of the "required" array as far as the text shows it (character offsets)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the parameters value is still open
    sent: int = 0  # arguments characters already streamed
    announced: bool = False


@dataclass(slots=True)
class ForcedToolStream:
    """One choice's streamed tool calls: push the text so far, get the deltas of `tool_calls`."""

    tool_choice: Any
    text: str = ""
    spans: list[_Span] = field(default_factory=list)
    made: bool = False

    def push(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        name = _named(self.tool_choice)
        if name is not None:
            if not delta:
                return []
            if self.made:
                return [{"index": 0, "function": {"arguments": delta}}]
            if not self.text.strip():
                return []
            self.made = True
            return [{"index": 0, "id": make_tool_call_id(), "type": "function",
                     "function": {"name": name, "arguments": self.text}}]
        self.spans = _scan(self.text, self.spans)
        out: list[dict[str, Any]] = []
        for index, span in enumerate(self.spans):
            if span.name is None or span.args_start is None:
                break  # items come in order: nothing later is ready
            end = span.args_end if span.args_end is not None else len(self.text)
            args = self.text[span.args_start + span.sent:end]
            span.sent += len(args)
            if not span.announced:
                span.announced = self.made = True
                out.append({"index": index, "id": make_tool_call_id(), "type": "function",
                            "function": {"name": span.name, "arguments": args}})
            elif args:
                out.append({"index": index, "function": {"arguments": args}})
        return out


def _scan(text: str, known: list[_Span]) -> list[_Span]:
    """The items of a (partial) JSON array of {"name", "parameters"} objects; known spans keep their sent
    counts. Only the item level is interpreted: strings and nesting inside values are skipped whole."""
    spans: list[_Span] = []
    depth, i, n = 0, 0, len(text)
    key: str | None = None
    expect_key = True
    while i < n:
        ch = text[i]
        if ch == '"':
            j = _string_end(text, i)
            if depth == 2:
                if j is None:
                    break
                raw = text[i:j + 1]
                if expect_key:
                    key = json.loads(raw)
                    expect_key = False
                elif key == "name":
                    spans[-1].name = json.loads(raw)
                i = j + 1
                continue
            if j is None:
                break
            i = j + 1
            continue
        if ch in "[{":
            if depth == 1 and ch == "{":
                spans.append(known[len(spans)] if len(spans) < len(known) else _Span())
                key, expect_key = None, True
            elif depth == 2 and key == "parameters" and spans:
                spans[-1].args_start = i
                end = _value_end(text, i)
                if end is None:
                    break
                spans[-1].args_end = end
                i = end
                continue
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                break
        elif depth == 2 and ch == ",":
            key, expect_key = None, True
        elif depth == 2 and key == "parameters" and not ch.isspace() and ch != ":" and spans:
            spans[-1].args_start = i  # a scalar value
            end = i
            while end < n and text[end] not in ",}" and not text[end].isspace():
                end += 1
            if end == n:
                break
            spans[-1].args_end = end
            i = end
            continue
        i += 1
    return spans


def _string_end(text: str, start: int) -> int | None:
    """Index of the closing quote of the string opening at `start` (None: not closed yet)."""
    i, n = start + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i
        i += 1
    return None


def _value_end(text: str, start: int) -> int | None:
    """Index just past the object or array opening at `start` (None: still open)."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = _string_end(text, i)
            if j is None:
                return None
            i = j + 1
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
