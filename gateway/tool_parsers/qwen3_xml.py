"""vLLM's `qwen3_xml` / `qwen3_coder` tool-call parser: Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

(`<tool_call>` may be left out). As vLLM: each value loses one leading and one trailing newline and is
converted to the type the tool's JSON Schema gives the parameter (integer, number, boolean, null, object,
array; a string otherwise, and always without a schema); a call cut off before `</function>` keeps its
complete parameters; the content is the text before the first call (null when blank).

Streaming sends the arguments as the JSON text of the result, growing: a string value as it is written, any
other value once its parameter closes, so the pieces concatenate to exactly the whole-output arguments.
Differences from vLLM's stream, which disagrees with its own whole result there: whitespace between the
content and a call is not streamed; text after the calls is never content; a parameter left open at the end
is not sent; vLLM strips leading whitespace off the content too (here it is kept, as streamed).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.tool_parsers.base import Delta, DeltaToolCall, Extracted, ToolCall, make_tool_call_id
from gateway.tool_parsers.sectioned import ContentBeforeCalls

_OPENERS = ("<tool_call>", "<function=")
_FUNC = re.compile(r"<function=([^>]*)>")
_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_OPEN_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)
_CLOSERS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
            "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
            "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer", "float": "number",
            "float32": "number", "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
            "arr": "array", "list": "array", "sequence": "array"}
_ENUM_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (type, enum values, anyOf/oneOf/allOf); {"string"} when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    t = schema.get("type")
    types.update([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    for v in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add(next(name for cls, name in _ENUM_TYPES if isinstance(v, cls)))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            types |= schema_types(choice)
    return types or {"string"}


def _finite(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except ValueError:
        return False
    return True


def coerce(value: str, types: set[str]) -> Any:
    """vLLM's coerce_to_schema_type: the first type in null > integer > number > boolean > object > array >
    string that the text converts to; else the text as JSON if it is some, else the text."""
    norm = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for cand in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if cand not in norm:
            continue
        if cand == "null" and value.lower() == "null":
            return None
        if cand == "string":
            return value
        if cand in ("integer", "number"):
            try:
                return int(value)
            except ValueError:
                pass
        if cand == "number":
            try:
                f = float(value)
            except ValueError:
                continue
            if math.isfinite(f):
                return f if f != int(f) else int(f)
        if cand == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if cand in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _trim(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


def _held_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the tail from the last "<" that may still grow into one of `tags`."""
    i = text.rfind("<")
    if i == -1:
        return 0
    tail = text[i:]
    return len(tail) if any(t.startswith(tail) for t in tags) else 0


class Qwen3XmlToolParser(ContentBeforeCalls):
    name = "qwen3_xml"
    starts = _OPENERS
    strip_content = True

    def _value(self, fn: str, key: str, raw: str) -> Any:
        props = self.tool_properties(fn)
        if not props or not isinstance(props.get(key), dict):
            return raw
        return coerce(raw, schema_types(props[key]))

    def _regions(self, text: str) -> list[tuple[str, str, bool]]:
        """(function name, body so far, closed) of each call whose name is complete."""
        out = []
        for m in _FUNC.finditer(text):
            end = text.find("</function>", m.end())
            nxt = _FUNC.search(text, m.end())
            stop = min([x for x in (end, nxt.start() if nxt else -1) if x != -1], default=-1)
            body = text[m.end():stop] if stop != -1 else text[m.end():]
            out.append((m.group(1).strip(), body, stop != -1))
        return out

    def _params(self, fn: str, body: str) -> dict[str, Any]:
        return {m.group(1).strip(): self._value(fn, m.group(1).strip(), _trim(m.group(2)))
                for m in _PARAM.finditer(body)}

    def extract(self, text: str) -> Extracted:
        start = self._first(text)
        if start == -1:
            return Extracted([], text)
        calls = [ToolCall(fn, json.dumps(self._params(fn, body), ensure_ascii=False))
                 for fn, body, _ in self._regions(text[start:])]
        if not calls:
            return Extracted([], text)
        before = text[:start]
        return Extracted(calls, before.rstrip() if before.strip() else None)

    def _stable_arguments(self, fn: str, body: str, closed: bool) -> str:
        """The arguments' JSON text as far as it can no longer change."""
        params = self._params(fn, body)
        if closed:
            return json.dumps(params, ensure_ascii=False)
        done = list(_PARAM.finditer(body))
        if len(params) < len(done):
            return ""  # a repeated key: its value may still change
        rest = body[done[-1].end():] if done else body
        m = _OPEN_PARAM.search(rest)
        if m is not None:
            if m.group(1).strip() in params:
                return ""
            open_key, open_value = m.group(1).strip(), m.group(2)
            open_value = open_value[:len(open_value) - _held_tail(open_value, _CLOSERS)].removeprefix("\n")
            open_value = open_value.removesuffix("\n")  # may be the newline the value loses
        elif done:  # as vLLM: the last value is sent once what follows it is known
            open_key, open_value = done[-1].group(1).strip(), _trim(done[-1].group(2))
            params.pop(open_key)
        else:
            return ""
        parts = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in params.items()]
        text = "{" + "".join(p + ", " for p in parts) + json.dumps(open_key, ensure_ascii=False) + ": "
        props = self.tool_properties(fn)
        if not props or not isinstance(props.get(open_key), dict) or schema_types(props[open_key]) == {"string"}:
            text += '"' + json.dumps(open_value, ensure_ascii=False)[1:-1]
        return text

    def extract_streaming(self, previous_text: str, current_text: str, delta_text: str) -> Delta | None:
        content = self._content(current_text)
        start = self._first(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (fn, body, closed) in enumerate(self._regions(current_text[start:]) if start != -1 else []):
            if i >= len(self.prev_calls):
                self.prev_calls.append({"name": fn})
                self.streamed_args.append("")
                deltas.append(DeltaToolCall(i, id=make_tool_call_id(), name=fn))
            args = self._stable_arguments(fn, body, closed)
            sent = self.streamed_args[i]
            if len(args) > len(sent) and args.startswith(sent):
                self.streamed_args[i] = self.prev_calls[i]["arguments"] = args
                deltas.append(DeltaToolCall(i, arguments=args[len(sent):]))
        if content or deltas:
            return Delta(content=content, tool_calls=deltas)
        return None
