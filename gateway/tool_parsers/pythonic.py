"""vLLM's `pythonic` tool-call parser (Llama 3.2 / 4, ToolACE): the whole output is a Python list of calls
with keyword arguments, literals only:

    [get_weather(city="Paris", days=3), get_time(tz='CET')]

As vLLM: an output that is not such a list is all content; arguments are JSON (None/True/False and
null/true/false become null/true/false, tuples and sets lists). The stream sends each call's name once its
"(" is written, then the arguments' JSON text as far as it can no longer change: each keyword argument once
the next one starts (a string value as it is written), the closing brace with the ")". (vLLM sends the name
and the first argument text in one piece; here the name comes alone first.)
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

from gateway.tool_parsers.base import Delta, DeltaToolCall, Extracted, ToolCall, ToolParser, make_tool_call_id

_CALLS = re.compile(r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*([a-zA-Z]+\w*\(([a-zA-Z]+\w*="
                    r".*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]", re.DOTALL)
_JSON_NAMES = {"null": None, "true": True, "false": False}
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\($")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(.*)$", re.DOTALL)


class _NotLiteral(ValueError):
    pass


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    raise _NotLiteral(ast.dump(node))


def _name(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _NotLiteral("call target")
    return ".".join([node.id, *reversed(parts)])


def _call(node: ast.Call) -> tuple[str, dict[str, Any]]:
    return _name(node.func), {k.arg: _value(k.value) for k in node.keywords}


def _structure(text: str) -> Iterator[tuple[int, str]]:
    """(position, character) of each bracket and comma outside string literals (escapes followed)."""
    quote, i = "", 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c in "([{)]},":
            yield i, c
        i += 1


def _scan(text: str) -> list[tuple[int, int]]:
    """(start, end) of each call in a partial list of calls (end -1 while the call is open)."""
    out: list[tuple[int, int]] = []
    depth, start, last_comma = 0, -1, 0
    for i, c in _structure(text):
        if c == "," and depth == 1:
            last_comma = i
        elif c in "([{":
            depth += 1
            if depth == 2 and start == -1:
                start = last_comma + 1
        elif c in ")]}":
            depth -= 1
            if depth == 1 and start != -1:
                out.append((start, i + 1))
                start = -1
    if start != -1:
        out.append((start, -1))
    return out


def _top_commas(body: str) -> list[int]:
    """Positions of the commas between a call's arguments (outside strings and brackets)."""
    commas, depth = [], 0
    for i, c in _structure(body):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            commas.append(i)
    return commas


def _open_string(raw: str) -> str | None:
    """The text so far of a string literal still being written, or None when `raw` is not one."""
    raw = raw.lstrip()
    if not raw or raw[0] not in "'\"" or raw[:3] in ('"""', "'''"):
        return None
    body = raw[1:]
    for cut in range(len(body), max(-1, len(body) - 10), -1):  # a half-written escape waits
        try:
            v = ast.literal_eval(raw[0] + body[:cut] + raw[0])
        except (ValueError, SyntaxError):
            continue
        return v if isinstance(v, str) else None
    return None


def _pair(key: str, value: Any) -> str:
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> Extracted:
        if _CALLS.match(text) is None:
            return Extracted([], text)
        try:
            node = getattr(ast.parse(text).body[0], "value", None)
            if not isinstance(node, ast.List) or not all(isinstance(e, ast.Call) for e in node.elts):
                return Extracted([], text)
            calls = [_call(e) for e in node.elts]  # type: ignore[arg-type]
        except (SyntaxError, ValueError, IndexError, RecursionError):
            return Extracted([], text)
        return Extracted([ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls], None)

    def unsent_content(self, text: str) -> str:
        """A stream that began like a list but made no calls is content, as the whole output is."""
        if text.startswith("[") and not self.prev_calls and self.extract(text).content is not None:
            return text
        return ""

    def _stable(self, piece: str, closed: bool) -> tuple[str | None, str]:
        """(the call's name once known, its arguments' JSON text as far as it is final)."""
        paren = piece.find("(")
        if paren == -1:
            return None, ""
        m = _NAME.match(piece[:paren + 1])
        if m is None:
            return None, ""
        if closed:
            try:
                node = ast.parse(piece.strip()).body[0].value  # type: ignore[attr-defined]
                return m.group(1), json.dumps(_call(node)[1], ensure_ascii=False)
            except (SyntaxError, ValueError, AttributeError, IndexError):
                return m.group(1), ""
        body = piece[paren + 1:]
        commas = _top_commas(body)
        done: list[str] = []
        for a, b in zip([-1, *commas], commas):
            km = _KWARG.match(body[a + 1:b])
            if km is None:
                return m.group(1), ""
            try:
                done.append(_pair(km.group(1), _value(ast.parse(km.group(2).strip(), mode="eval").body)))
            except (SyntaxError, ValueError):
                return m.group(1), ""
        text = "{" + "".join(d + ", " for d in done) if done else ""
        km = _KWARG.match(body[(commas[-1] + 1) if commas else 0:])
        if km is not None:
            text = (text or "{") + json.dumps(km.group(1), ensure_ascii=False) + ": "
            partial = _open_string(km.group(2))
            if partial is not None:
                text += '"' + json.dumps(partial, ensure_ascii=False)[1:-1]
        elif done:
            text = text[:-2]  # the separator waits for the next key (a trailing comma may close the call)
        return m.group(1), text

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        if not current_text.startswith("["):
            return Delta(content=delta_text) if delta_text else None
        deltas: list[DeltaToolCall] = []
        for i, (start, end) in enumerate(_scan(current_text)):
            piece = current_text[start:end] if end != -1 else current_text[start:]
            name, args = self._stable(piece.lstrip(" ,\n"), end != -1)
            if name is None:
                break
            if i >= len(self.prev_calls):
                self.prev_calls.append({"name": name})
                self.streamed_args.append("")
                deltas.append(DeltaToolCall(i, id=make_tool_call_id(), name=name))
            sent = self.streamed_args[i]
            if len(args) > len(sent) and args.startswith(sent):
                self.streamed_args[i] = self.prev_calls[i]["arguments"] = args
                deltas.append(DeltaToolCall(i, arguments=args[len(sent):]))
        return Delta(tool_calls=deltas) if deltas else None
