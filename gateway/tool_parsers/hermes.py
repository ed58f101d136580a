"""vLLM's `hermes` tool-call parser (also `qwen3_json`): calls as JSON inside <tool_call>...</tool_call>,
the format of Hermes-2-Pro, Qwen2.5 and Qwen3:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As vLLM: the content is the text before the first <tool_call>; a whole output whose calls do not parse is
returned as content with no calls; arguments of a whole output are re-serialised (json.dumps), while the
stream sends the argument text as the model wrote it (the two agree when the model writes JSON with
json.dumps' spacing, as these models do).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tool_parsers.base import (
    Delta,
    DeltaToolCall,
    Extracted,
    ToolCall,
    ToolParser,
    is_complete_json,
    make_tool_call_id,
    partial_tag_overlap,
)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tokenizer: object = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._sent_content = 0

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False  # vLLM: <tool_call> is a special token in some models

    def extract(self, text: str) -> Extracted:
        if START not in text:
            return Extracted([], text)
        try:
            raw = [json.loads(a if a else b) for a, b in _CALLS.findall(text)]
            calls = [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in raw]
        except (ValueError, KeyError, TypeError):
            return Extracted([], text)  # vLLM: a call that does not parse leaves the output as content
        content = text[:text.find(START)]
        return Extracted(calls, content or None)

    def _content(self, text: str) -> str | None:
        """Unsent text before the first <tool_call>, holding back what may still become the tag."""
        end = text.index(START) if START in text else len(text) - partial_tag_overlap(text, START)
        if end > self._sent_content:
            out, self._sent_content = text[self._sent_content:end], end
            return out
        return None

    def unsent_content(self, text: str) -> str:
        if START in text:
            return ""
        out, self._sent_content = text[self._sent_content:], len(text)
        return out

    @staticmethod
    def _bodies(text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each <tool_call> region so far."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            body = start + len(START)
            end = text.find(END, body)
            if end != -1:
                out.append((text[body:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[body:]
            cut = partial_tag_overlap(raw, END)
            raw = (raw[:-cut] if cut else raw).strip()
            out.append((raw, is_complete_json(raw) if raw else False))  # whole JSON: the end tag is coming
            break
        return out

    @staticmethod
    def _arguments(body: str, complete: bool) -> str | None:
        """The text after `"arguments":`; of a complete body, without the brace closing the outer object."""
        m = _ARGS.search(body)
        if m is None:
            return None
        raw = body[m.end():]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        content = self._content(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (body, complete) in enumerate(self._bodies(current_text)):
            if i >= len(self.prev_calls):
                self.prev_calls.append({})
                self.streamed_args.append("")
            if "name" not in self.prev_calls[i]:
                m = _NAME.search(body)
                if m is None:
                    break  # the name of call i comes before anything of call i + 1
                self.prev_calls[i]["name"] = m.group(1)
                deltas.append(DeltaToolCall(i, id=make_tool_call_id(), name=m.group(1)))
            args = self._arguments(body, complete)
            if args is not None and len(args) > len(self.streamed_args[i]):
                diff = args[len(self.streamed_args[i]):]
                self.streamed_args[i] = self.prev_calls[i]["arguments"] = args
                deltas.append(DeltaToolCall(i, arguments=diff))
        if content or deltas:
            return Delta(content=content, tool_calls=deltas)
        return None
