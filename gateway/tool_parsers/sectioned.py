"""What the marker-delimited call formats share (DeepSeek, Kimi-K2, GLM-4.5, Mistral): content is the text
before the first call marker; the calls follow it. A subclass reads the calls of that region (`calls`), and
this class makes the whole-output result and the stream from it, so the two agree: the stream sends a call's
name once it is complete, then its arguments as far as they can no longer change, the rest once the call
closes or the output ends. Calls cut off by the end of the output are kept or dropped by each format as
vLLM does; the stream cannot know that in advance, so only there the two may differ.

The markers are special tokens in these models' vocabularies: the parsers turn skip_special_tokens off, as
vLLM's adjust_request does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.tool_parsers.base import (
    Delta,
    DeltaToolCall,
    Extracted,
    ToolCall,
    ToolParser,
    make_tool_call_id,
    partial_tag_overlap,
)


@dataclass
class CallText:
    name: str | None  # None: not complete yet (the stream waits for it)
    arguments: str  # final once `closed` (or of a whole output); else the part that can no longer change
    closed: bool = True
    id: str | None = None  # the model's own call id, where the format has one


def stable_prefix(raw: str, enders: tuple[str, ...]) -> str:
    """`raw` without leading and trailing whitespace and without a tail that may still become an ender."""
    raw = raw.lstrip()
    cut = max((partial_tag_overlap(raw, e) for e in enders), default=0)
    return raw[:len(raw) - cut].rstrip()


def first_json_value(raw: str) -> tuple[str, bool]:
    """(the first JSON value's text in `raw`, stripped, and whether it is complete); the whole text when it
    does not start a JSON value."""
    text = raw.strip()
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return text, False
    return text[:end], True


def open_object(params: dict[str, Any], closed: bool) -> str:
    """The JSON text of `params`; while more may come, without its closing brace (a prefix of the final)."""
    text = json.dumps(params, ensure_ascii=False)
    return text if closed else text[:-1]


class ContentBeforeCalls(ToolParser):
    """The content is the text before the first of `starts`; streamed, a tail that may still become a start
    marker is held back."""

    starts: tuple[str, ...] = ()  # markers that open the calls
    strip_content = False  # vLLM strips the content before calls (here its trailing whitespace, as streamed)

    def __init__(self, tokenizer: object = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._sent_content = 0

    def _first(self, text: str) -> int:
        found = [i for i in (text.find(s) for s in self.starts) if i != -1]
        return min(found) if found else -1

    def _content(self, text: str) -> str | None:
        start = self._first(text)
        end = start if start != -1 else len(text) - max(partial_tag_overlap(text, s) for s in self.starts)
        if self.strip_content:  # trailing whitespace waits for more text (before a call it is dropped)
            end = len(text[:end].rstrip()) if text[:end].strip() else self._sent_content
        if end > self._sent_content:
            out, self._sent_content = text[self._sent_content:end], end
            return out
        return None

    def unsent_content(self, text: str) -> str:
        if self._first(text) != -1 and self.extract(text).tools_called:
            return ""
        out, self._sent_content = text[self._sent_content:], len(text)  # no call: the whole output is content
        return out


class SectionedToolParser(ContentBeforeCalls):
    def __init__(self, tokenizer: object = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._text = ""

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False

    def calls(self, region: str, final: bool) -> list[CallText]:
        """The calls in `region` (the text from the first start marker on). `final`: the output ends here."""
        raise NotImplementedError

    def new_id(self) -> str:
        return make_tool_call_id()

    def tool_names(self) -> set[str]:
        return {(t.get("function") or {}).get("name") for t in self.tools} - {None}

    def extract(self, text: str) -> Extracted:
        start = self._first(text)
        if start == -1:
            return Extracted([], text)
        calls = [ToolCall(c.name, c.arguments, c.id or self.new_id())
                 for c in self.calls(text[start:], final=True) if c.name]
        if not calls:
            return Extracted([], text)  # as vLLM: no call parsed, the output is content
        content = text[:start].rstrip() if self.strip_content else text[:start]
        return Extracted(calls, content or None)

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        self._text = current_text
        content = self._content(current_text)
        start = self._first(current_text)
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(self.calls(current_text[start:], final=False) if start != -1 else []):
            if call.name is None:
                break  # call i's name comes before anything of call i + 1
            if i >= len(self.prev_calls):
                self.prev_calls.append({"name": call.name})
                self.streamed_args.append("")
                deltas.append(DeltaToolCall(i, id=call.id or self.new_id(), name=call.name))
            sent = self.streamed_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.streamed_args[i] = self.prev_calls[i]["arguments"] = call.arguments
                deltas.append(DeltaToolCall(i, arguments=call.arguments[len(sent):]))
        if content or deltas:
            return Delta(content=content, tool_calls=deltas)
        return None

    def remaining_arguments(self) -> str:
        """At the end of the stream: what the last call's final arguments add to what was sent."""
        start = self._first(self._text)
        if start == -1 or not self.prev_calls:
            return ""
        i = len(self.prev_calls) - 1
        found = [c for c in self.calls(self._text[start:], final=True)]
        if i >= len(found) or found[i].name is None:
            return ""
        final, sent = found[i].arguments, self.streamed_args[i]
        if len(final) > len(sent) and final.startswith(sent):
            self.streamed_args[i] = final
            return final[len(sent):]
        return ""
