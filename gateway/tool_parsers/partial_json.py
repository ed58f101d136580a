"""Parse the JSON a model has written so far: `loads_partial(text)` returns (value, end) for the first JSON
value in `text`, completing what is cut off at the end (an open string keeps its characters, open arrays and
objects keep their complete members; a key without its value, a half-written number, literal or escape is
left out). With `strings=False`, an unfinished string is left out too. Raises ValueError on text that is not
the start of JSON.
"""

from __future__ import annotations

import json
from typing import Any

_WS = " \t\n\r"
_LITERALS = {"true": True, "false": False, "null": None}
_NUMBER_CHARS = set("+-0123456789.eE")


class _Cut(Exception):
    """The text ended inside a value that cannot be completed (a key, a number, a literal)."""


class _Parser:
    def __init__(self, text: str, strings: bool) -> None:
        self.s, self.i, self.strings = text, 0, strings

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in _WS:
            self.i += 1

    def value(self) -> Any:
        self.ws()
        if self.i >= len(self.s):
            raise _Cut
        c = self.s[self.i]
        if c == "{":
            return self.obj()
        if c == "[":
            return self.arr()
        if c == '"':
            text, done = self.string()
            if not done and not self.strings:
                raise _Cut  # string() has moved to the end
            return text
        if c in _NUMBER_CHARS:
            return self.number()
        for word, v in _LITERALS.items():
            if self.s.startswith(word, self.i):
                self.i += len(word)
                return v
            if word.startswith(self.s[self.i:]):
                self.i = len(self.s)
                raise _Cut
        raise ValueError(f"not JSON at {self.i}: {self.s[self.i:self.i + 10]!r}")

    def string(self) -> tuple[str, bool]:
        """(the text, whether the string closed)."""
        j = self.i + 1
        while j < len(self.s):
            if self.s[j] == "\\":
                j += 2
                continue
            if self.s[j] == '"':
                out = json.loads(self.s[self.i:j + 1])
                self.i = j + 1
                return out, True
            j += 1
        body = self.s[self.i + 1:]
        self.i = len(self.s)
        for cut in range(len(body), max(-1, len(body) - 7), -1):  # drop a half-written escape
            try:
                return json.loads('"' + body[:cut] + '"'), False
            except ValueError:
                continue
        return "", False

    def number(self) -> Any:
        j = self.i
        while j < len(self.s) and self.s[j] in _NUMBER_CHARS:
            j += 1
        raw = self.s[self.i:j]
        if j >= len(self.s):
            self.i = j
            raise _Cut  # more digits may follow
        self.i = j
        return json.loads(raw)

    def obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.i += 1
        while True:
            self.ws()
            if self.i >= len(self.s):
                return out
            if self.s[self.i] == "}":
                self.i += 1
                return out
            if self.s[self.i] == ",":
                self.i += 1
                continue
            if self.s[self.i] != '"':
                raise ValueError(f"not JSON at {self.i}")
            key, done = self.string()
            self.ws()
            if not done or self.i >= len(self.s):
                return out
            if self.s[self.i] != ":":
                raise ValueError(f"not JSON at {self.i}")
            self.i += 1
            try:
                out[key] = self.value()
            except _Cut:
                return out

    def arr(self) -> list[Any]:
        out: list[Any] = []
        self.i += 1
        while True:
            self.ws()
            if self.i >= len(self.s):
                return out
            if self.s[self.i] == "]":
                self.i += 1
                return out
            if self.s[self.i] == ",":
                self.i += 1
                continue
            try:
                out.append(self.value())
            except _Cut:
                return out


def loads_partial(text: str, strings: bool = True) -> tuple[Any, int]:
    p = _Parser(text, strings)
    try:
        v = p.value()
    except _Cut:
        return None, len(text)
    return v, p.i
