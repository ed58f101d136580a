"""One response's output, streamed: chat deltas (reasoning, content, tool calls, as gateway/serving_chat.py's
`choice_delta` makes them) -> the Responses API's streaming events, in vLLM 0.33's shapes, and the output
items they add up to. Pure: no I/O.

Items come in the order the model writes them (reasoning, then text, then one item per function call, as
vLLM streams them); a change of kind closes the open item (its `*.done`, `content_part.done` and
`output_item.done` events) and opens the next (`output_item.added`, `content_part.added`). Each item has
its id from the first event on, so the items of `response.completed` are the streamed ones.
"""

from __future__ import annotations

import uuid
from typing import Any

import structlog

log = structlog.get_logger()
Event = dict[str, Any]


def _uid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputStream:
    """The open item and the finished ones; `push` each delta, then `close`."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # finished, in output order
        self._open: dict[str, Any] | None = None  # {"kind", "item", "text", "logprobs", "call"}
        self._closed_calls: set[int] = set()
        self._pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text is still held back

    @property
    def _index(self) -> int:
        return len(self.items)

    def push(self, delta: dict[str, Any] | None, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """The events of one chat delta; `logprobs` those of its tokens (they go with the output text)."""
        self._pending_logprobs += logprobs or []
        if not delta:
            return []
        events: list[Event] = []
        if delta.get("reasoning"):
            events += self._ensure("reasoning")
            events.append(self._text_delta("response.reasoning_text.delta", delta["reasoning"]))
        if delta.get("content"):
            events += self._ensure("message")
            lps, self._pending_logprobs = self._pending_logprobs, []
            self._open["logprobs"] += lps  # type: ignore[index]
            events.append({**self._text_delta("response.output_text.delta", delta["content"]), "logprobs": lps})
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if delta.get("tool_calls") or delta.get("reasoning"):
            self._pending_logprobs = []  # those tokens were not output text
        return events

    def close(self) -> list[Event]:
        return self._close()

    # ---------------------------------------------------------------- items

    def _ensure(self, kind: str, call: int | None = None) -> list[Event]:
        """Open an item of this kind unless it is the open one."""
        if self._open is not None and self._open["kind"] == kind and self._open["call"] == call:
            return []
        events = self._close()
        index = self._index
        if kind == "reasoning":
            item = {"id": _uid("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _uid("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open = {"kind": kind, "item": item, "text": "", "logprobs": [], "call": call}
        events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        events.append({"type": "response.content_part.added", "output_index": index, "item_id": item["id"],
                       "content_index": 0, "part": part})
        return events

    def _text_delta(self, kind: str, text: str) -> Event:
        assert self._open is not None
        self._open["text"] += text
        return {"type": kind, "output_index": self._index, "item_id": self._open["item"]["id"], "content_index": 0,
                "delta": text}

    def _call(self, call: dict[str, Any]) -> list[Event]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index in self._closed_calls:  # parsers send a call's pieces together: cannot happen
            log.warning("gateway.responses_late_call_delta", index=index)
            return []
        events: list[Event] = []
        if self._open is None or self._open["call"] != index:
            events += self._close()
            item = {"id": _uid("fc"), "type": "function_call", "call_id": call.get("id") or _uid("call"),
                    "name": function.get("name") or "", "arguments": "", "status": "in_progress"}
            self._open = {"kind": "function_call", "item": item, "text": "", "logprobs": [], "call": index}
            events.append({"type": "response.output_item.added", "output_index": self._index, "item": dict(item)})
        arguments = function.get("arguments")
        if arguments:
            self._open["text"] += arguments  # type: ignore[index]
            events.append({"type": "response.function_call_arguments.delta", "output_index": self._index,
                           "item_id": self._open["item"]["id"], "delta": arguments})  # type: ignore[index]
        return events

    def _close(self) -> list[Event]:
        """The events that finish the open item (none when none is open)."""
        if self._open is None:
            return []
        opened, self._open = self._open, None
        item, text, index = dict(opened["item"]), opened["text"], self._index
        head = {"output_index": index, "item_id": item["id"]}
        events: list[Event] = []
        if opened["kind"] == "function_call":
            self._closed_calls.add(opened["call"])
            item.update(arguments=text, status="completed")
            events.append({"type": "response.function_call_arguments.done", **head, "arguments": text,
                           "name": item["name"]})
        elif opened["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item.update(content=[part], encrypted_content=None, status="completed")
            events.append({"type": "response.reasoning_text.done", **head, "content_index": 0, "text": text})
            events.append({"type": "response.content_part.done", **head, "content_index": 0, "part": part})
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": opened["logprobs"]}
            item.update(content=[part], status="completed")
            events.append({"type": "response.output_text.done", **head, "content_index": 0, "text": text,
                           "logprobs": opened["logprobs"]})
            events.append({"type": "response.content_part.done", **head, "content_index": 0, "part": part})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        self.items.append(item)
        return events
