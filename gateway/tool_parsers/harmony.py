"""gpt-oss's harmony format: `--tool-call-parser openai` and `--reasoning-parser openai_gptoss` (vLLM's names;
that one is gateway/reasoning_parsers.py).

The model writes messages, each a header, `<|message|>` and a body ended by `<|end|>`, `<|call|>` or
`<|return|>` (the last two are stop tokens, so they are usually not in the output); a later message starts
with `<|start|>`. The chat prompt ends with `<|start|>assistant`, so the output begins with a header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(one line). As vLLM's HarmonyParser, by the header's channel and recipient (`to=...`, before or after the
channel): a `functions.NAME` recipient (or any recipient but `assistant` and the built-in python / browser /
container tools) is a call of NAME, whose body is its arguments; `analysis` is reasoning; `final`, and
`commentary` without a recipient, are content; anything else is dropped. Several reasoning or content
messages are joined by a newline. A call's arguments are re-serialised (`json.dumps(json.loads(body))`, as
vLLM) when its content type is JSON or unset and the body parses, else kept as written; the stream sends
them as written. An output that ends inside a header is returned as content, raw, as vLLM recovers it.

Parsing needs the special tokens in the decoded text: both parsers turn skip_special_tokens off.
Differences from vLLM's stream, which disagrees with its own whole result there: the newline joining two
content (or reasoning) messages is streamed; a call's name comes alone, before its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *ENDS)
_BUILTIN_TOOLS = ("python", "browser", "container")  # vLLM's BUILTIN_TOOL_TO_MCP_SERVER_LABEL keys


@dataclass
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = recipient = content_type = None
        words = text.replace(CHANNEL, f" {CHANNEL} ").replace(CONSTRAIN, f" {CONSTRAIN} ").split()
        rest = []
        for k, w in enumerate(words):
            if words[k - 1] == CHANNEL and k:
                channel = w
            elif words[k - 1] == CONSTRAIN and k:
                content_type = w
            elif w.startswith("to="):
                recipient = w[3:] or None
            elif w not in (CHANNEL, CONSTRAIN):
                rest.append(w)
        if content_type is None and recipient is not None and rest and rest[-1] != "assistant":
            content_type = rest[-1]  # `to=functions.f json`: the content type without <|constrain|>
        return cls(channel, recipient, content_type)

    @property
    def function(self) -> str | None:
        """The called function's name, when the recipient is a function (vLLM's is_function_recipient)."""
        r = self.recipient
        if not r or r.startswith("<|") or r == "assistant" or r.split(".", 1)[0] in _BUILTIN_TOOLS:
            return None
        if r.startswith("functions."):
            return r.removeprefix("functions.") or None
        return r

    def kind(self) -> str:
        if self.function is not None:
            return "tool"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "ignore"


@dataclass
class Message:
    start: int  # where the message starts in the text (its <|start|> included)
    header: Header | None  # None while (or when) the header is not complete
    body: str
    closed: bool


def read_messages(text: str, pos: int = 0) -> list[Message]:
    """The messages from `pos` on; the last one may be open (no end marker yet) or headerless."""
    out: list[Message] = []
    while pos < len(text):
        start = pos
        if text.startswith(START, pos):
            pos += len(START)
        m = text.find(MESSAGE, pos)
        nxt = text.find(START, pos)
        if m == -1 or (nxt != -1 and nxt < m):  # no body: the header runs to the end (or a stray start)
            if nxt == -1:
                out.append(Message(start, None, text[pos:], False))
                break
            pos = nxt
            continue
        body_at = m + len(MESSAGE)
        ends = [(i, t) for t in (*ENDS, START) if (i := text.find(t, body_at)) != -1]
        header = Header.parse(text[pos:m])
        if not ends:
            out.append(Message(start, header, text[body_at:], False))
            break
        end, marker = min(ends)
        out.append(Message(start, header, text[body_at:end], True))
        pos = end + (len(marker) if marker != START else 0)
    return out


def call_arguments(header: Header, body: str) -> str:
    if header.content_type is not None and "json" not in header.content_type:
        return body
    try:
        return json.dumps(json.loads(body))
    except ValueError:
        return body


class HarmonyOutput:
    """One choice's harmony output: `parse` a whole one, or `feed` deltas (one instance per stream)."""

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._text = ""
        self._from = 0  # where the first message not yet finished starts
        self._index = 0  # its index among all messages
        self._sent: dict[int, int] = {}  # message index -> body characters sent
        self._calls: dict[int, int] = {}  # message index -> call index
        self._said = {"content": False, "reasoning": False}  # whether a message of each kind sent text

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        calls = []
        for m in read_messages(text):
            if m.header is None:
                parts["content"].append(text[m.start:])  # vLLM: the unparsable rest, raw
                continue
            kind = m.header.kind()
            if kind == "tool" and self.tools:
                calls.append(ToolCall(str(m.header.function), call_arguments(m.header, m.body)))
            elif kind in parts and m.body and (kind == "content" or self.reasoning):
                parts[kind].append(m.body)
        return ("\n".join(parts["reasoning"]) or None, "\n".join(parts["content"]) or None, calls)

    def feed(self, delta_text: str, finished: bool) -> Delta:
        self._text += delta_text
        out = Delta()
        messages = read_messages(self._text, self._from)
        for k, m in enumerate(messages):
            i = self._index + k
            if m.header is None:
                if finished:
                    self._send(out, "content", i, self._text[m.start:])
                continue
            body = m.body
            if not m.closed and not finished:
                body = body[:len(body) - max(partial_tag_overlap(body, t) for t in MARKERS)]
            self._emit(out, i, m.header, body)
        done = [m for m in messages if m.closed]
        if done and len(done) < len(messages):
            self._from, self._index = messages[len(done)].start, self._index + len(done)
        elif done:
            self._from, self._index = len(self._text), self._index + len(done)
        return out

    def _emit(self, out: Delta, i: int, header: Header, body: str) -> None:
        kind = header.kind()
        if kind == "tool":
            if not self.tools:
                return
            if i not in self._calls:
                self._calls[i] = len(self._calls)
                out.tool_calls.append(DeltaToolCall(self._calls[i], id=make_tool_call_id(), name=header.function))
            new = body[self._sent.get(i, 0):]
            if new:
                self._sent[i] = len(body)
                out.tool_calls.append(DeltaToolCall(self._calls[i], arguments=new))
        elif kind == "content" or (kind == "reasoning" and self.reasoning):
            self._send(out, kind, i, body)

    def _send(self, out: Delta, kind: str, i: int, body: str) -> None:
        new = body[self._sent.get(i, 0):]
        if not new:
            return
        if i not in self._sent and self._said[kind]:
            new = "\n" + new  # the whole result joins messages with a newline
        self._sent[i] = len(body)
        self._said[kind] = True
        setattr(out, kind, (getattr(out, kind) or "") + new)


def count_reasoning_tokens(tokenizer: Any, token_ids: Sequence[int]) -> int:
    """vLLM's count: tokens of analysis bodies and of calls' bodies, markers not counted."""
    count, header, in_body = 0, "", False
    for t in token_ids:
        piece = tokenizer.decode([t], skip_special_tokens=False)
        if piece == START:
            header, in_body = "", False
        elif piece == MESSAGE:
            in_body = True
        elif piece in ENDS:
            in_body = False
        elif in_body:
            h = Header.parse(header)
            count += h.channel == "analysis" or (h.channel == "commentary" and h.recipient is not None)
        else:
            header += piece
    return count


class HarmonyToolParser(ToolParser):
    """`openai`: calls are messages to `functions.NAME`; the content is the final and commentary text."""

    name = "openai"

    def __init__(self, tokenizer: object = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._stream = HarmonyOutput(reasoning=False, tools=True)
        self._last: Delta | None = None  # the end of the stream: what the held-back text still adds

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False

    def extract(self, text: str) -> Extracted:
        _, content, calls = HarmonyOutput(reasoning=False, tools=True).parse(text)
        return Extracted(calls, content)

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        d = self._stream.feed(delta_text, finished=False)
        return None if d.empty() else d

    def _end(self) -> Delta:
        if self._last is None:
            self._last = self._stream.feed("", finished=True)
        return self._last

    def remaining_arguments(self) -> str:
        return "".join(c.arguments or "" for c in self._end().tool_calls)

    def unsent_content(self, text: str) -> str:
        return self._end().content or ""
