"""vLLM's `llama3_json` / `llama4_json` tool-call parser: Llama 3.x / 4 JSON calls, optionally after
<|python_tag|>, several separated by "; ":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(`parameters` or `arguments`). As vLLM: a call's arguments are re-serialised (json.dumps); an output with
calls has no content; one whose JSON does not parse as calls is all content. The stream sends a name once
it is complete, then the arguments' JSON text as far as it can no longer change (the common prefix of the
successive partial parses), the rest when the call's JSON closes, so the pieces concatenate to the
whole-output arguments.

One difference from vLLM: an output is read as calls only when it starts with <|python_tag|> or "{", in
the whole-output path too (vLLM's whole path also finds calls after text, which its stream sends as content).
"""

from __future__ import annotations

import json
import os
from typing import Any

from gateway.tool_parsers.base import (
    Delta,
    DeltaToolCall,
    Extracted,
    ToolCall,
    ToolParser,
    is_complete_json,
    make_tool_call_id,
)
from gateway.tool_parsers.partial_json import loads_partial

BOT = "<|python_tag|>"


def _arguments(obj: dict[str, Any]) -> Any:
    return obj["arguments"] if "arguments" in obj else obj["parameters"]


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tokenizer: object = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._current = -1
        self._name_sent = False
        self._names = 0  # names sent

    @staticmethod
    def _is_call_text(text: str) -> bool:
        return text.startswith(BOT) or text.startswith("{")

    def extract(self, text: str) -> Extracted:
        if not self._is_call_text(text):
            return Extracted([], text)
        decoder = json.JSONDecoder()
        calls, end = [], -1
        for start in (i for i, c in enumerate(text) if c == "{"):
            if start <= end:
                continue
            try:
                obj, n = decoder.raw_decode(text[start:])
                end = start + n
                calls.append(ToolCall(obj["name"], json.dumps(_arguments(obj), ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return Extracted([], text)
        return Extracted(calls, None) if calls else Extracted([], text)

    def unsent_content(self, text: str) -> str:
        """A stream that looked like calls but made none: the whole-output path returns it as content."""
        if self._is_call_text(text) and not self._names and self.extract(text).content is not None:
            return text
        return ""

    def remaining_arguments(self) -> str:
        return super().remaining_arguments() if self._name_sent else ""

    def _parse(self, text: str) -> tuple[list[dict[str, Any]], list[bool]] | None:
        calls, complete = [], []
        start = len(BOT) if text.startswith(BOT) else 0
        while start < len(text):
            try:
                obj, n = loads_partial(text[start:], strings=self._name_sent)
            except ValueError:
                return None
            if not isinstance(obj, dict):
                break
            complete.append(is_complete_json(text[start:start + n]))
            start += n + len("; ")
            if "parameters" in obj and "arguments" not in obj:
                obj["arguments"] = obj["parameters"]
            calls.append(obj)
        return calls, complete

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        if BOT.startswith(current_text):
            return None  # may become the tag (one token in Llama's vocabulary, several elsewhere)
        if not self._is_call_text(current_text):
            return Delta(content=(previous_text + delta_text) if BOT.startswith(previous_text) else delta_text)
        parsed = self._parse(current_text)
        if parsed is None or not parsed[0]:
            return None
        calls, complete = parsed
        out: DeltaToolCall | None = None
        if len(calls) > self._current + 1:  # a new call starts: first send what the last one still lacks
            if self._current >= 0:
                rest = self._remaining(calls[self._current])
                out = DeltaToolCall(self._current, arguments=rest) if rest else None
            self._current = len(calls) - 1
            self._name_sent = False
            self.streamed_args.append("")
        elif not self._name_sent:
            name = calls[self._current].get("name")
            if isinstance(name, str) and name:
                out = DeltaToolCall(self._current, id=make_tool_call_id(), name=name)
                self._name_sent = True
                self._names += 1
        else:
            args = calls[self._current].get("arguments")
            if args:
                now = json.dumps(args, ensure_ascii=False)
                sent = self.streamed_args[self._current]
                if complete[self._current]:
                    diff = now[len(sent):]
                else:
                    before = self.prev_calls[self._current].get("arguments") if self._current < len(
                        self.prev_calls) else None
                    old = json.dumps(before, ensure_ascii=False) if before else None
                    diff = os.path.commonprefix([old, now])[len(sent):] if old and old != now else ""
                if diff:
                    self.streamed_args[self._current] += diff
                    out = DeltaToolCall(self._current, arguments=diff)
        self.prev_calls = calls
        return Delta(tool_calls=[out]) if out is not None else None

    def _remaining(self, call: dict[str, Any]) -> str:
        args = call.get("arguments")
        if not args:
            return ""
        now = json.dumps(args, ensure_ascii=False)
        sent = self.streamed_args[self._current]
        rest = now[len(sent):] if now.startswith(sent) else ""
        self.streamed_args[self._current] += rest
        return rest
