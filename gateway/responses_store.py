"""The Responses API's state, in the gateway's memory: stored responses (for GET, `previous_response_id` and
cancel), and the events of background streams. Bounded by --max-stored-responses: the oldest finished
response makes room for a new one (later a 404 for its id says it may have been evicted); when every slot is
held by a response still running, a new stored request is a 429 naming the limit. Nothing survives a restart
of the gateway.

A stored response keeps the chat messages its request added and a link to the response it continued, so a
conversation's history is shared by its turns, not copied into each (and survives the eviction of an
earlier turn's id while a later turn is stored).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import NOT_FOUND, APIError, bad_request
from gateway.responses_protocol import items_to_messages

LIMIT_FLAG = "--max-stored-responses"
RUNNING = ("queued", "in_progress")


@dataclass(eq=False)
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it
    turn: list[dict[str, Any]]  # the chat messages this request added (its input)
    parent: StoredResponse | None = None  # the response it continued (previous_response_id)
    background: bool = False
    events: list[bytes] | None = None  # SSE frames, for a background stream (GET ?stream=true replays them)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever events grow or it finishes
    task: asyncio.Task | None = None  # a background response's run, until it is over

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING

    def history(self) -> list[dict[str, Any]]:
        """The conversation up to and including this response's output, as chat messages."""
        chain = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        messages: list[dict[str, Any]] = []
        for node in reversed(chain):
            messages += node.turn
            messages += items_to_messages(node.response["output"], "previous_response.output")
        return messages

    def add_event(self, frame: bytes) -> None:
        if self.events is not None:
            self.events.append(frame)
        self.changed.set()

    def finish(self, response: dict[str, Any]) -> None:
        """The final response object (unless it was cancelled meanwhile, which stays cancelled)."""
        if self.response["status"] != "cancelled":
            self.response = response
        self.changed.set()


class ResponseStore:
    def __init__(self, limit: int):
        self.limit = limit
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def not_found(self, response_id: str, param: str = "response_id") -> APIError:
        """vLLM's 404, with where the response may have gone."""
        return APIError(f"Response with id '{response_id}' not found. This server keeps the last {self.limit} "
                        f"stored responses in memory ({LIMIT_FLAG}; older ones are evicted) and none across "
                        "restarts.", status=404, type=NOT_FOUND, param=param)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise self.not_found(response_id, param)
        return entry

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues: it must be stored and finished."""
        entry = self.get(response_id, "previous_response_id")
        if entry.running:
            raise bad_request(f"Response with id '{response_id}' is still {entry.response['status']}; continue it "
                              "once it has finished.", "previous_response_id")
        return entry

    def put(self, entry: StoredResponse) -> None:
        """Store a new response, evicting the oldest finished ones beyond the limit."""
        if entry.id in self._entries:
            raise bad_request(f"A response with id '{entry.id}' already exists", "request_id")
        while len(self._entries) >= self.limit:
            oldest = next((k for k, e in self._entries.items() if not e.running), None)
            if oldest is None:
                raise APIError(f"This server already holds {self.limit} stored responses that are still running, "
                               f"its limit ({LIMIT_FLAG}); retry when one has finished, or send store=false.",
                               status=429, type="RateLimitError", param="store")
            evicted = self._entries.pop(oldest)
            evicted.events = None  # its turns may live on as a later response's history; its events do not
        self._entries[entry.id] = entry

    def discard(self, entry: StoredResponse) -> None:
        """Forget a response that never finished (its client went away, or it failed before any output)."""
        if self._entries.get(entry.id) is entry:
            del self._entries[entry.id]
