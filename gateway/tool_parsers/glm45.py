"""vLLM's `glm45` tool-call parser (GLM-4.5 / 4.6 / 4.7; vLLM's glm47 engine serves both names). Calls as
XML-like tags after the content:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7 writes no newlines.) As vLLM: the name is the text before the first <arg_key>; a value is the text
between its tags, as written, typed by the tool's JSON Schema (integer, number, boolean, object, ...; a
string without a schema); a name that is not among the request's tools makes no call; a call cut off by
the end of the output keeps its complete arguments; the content before the calls is stripped (here its
trailing whitespace, as streamed). The stream sends each argument once its </arg_value> closes.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.tool_parsers.qwen3_xml import coerce, schema_types
from gateway.tool_parsers.sectioned import CallText, SectionedToolParser, open_object

CALL_BEGIN, CALL_END, KEY = "<tool_call>", "</tool_call>", "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(SectionedToolParser):
    name = "glm45"
    starts = (CALL_BEGIN,)
    strip_content = True

    def _value(self, fn: str, key: str, raw: str) -> Any:
        props = self.tool_properties(fn)
        if not isinstance(props.get(key), dict):
            return raw
        return coerce(raw, schema_types(props[key]))

    def calls(self, region: str, final: bool) -> list[CallText]:
        out = []
        known = self.tool_names()
        for piece in region.split(CALL_BEGIN)[1:]:
            closed = CALL_END in piece
            body = piece.split(CALL_END, 1)[0]
            cut = [i for i in (body.find(KEY), len(body) if closed else -1) if i != -1]
            if not cut:
                out.append(CallText(None, ""))
                break
            name = body[:min(cut)].strip()
            if not name or (known and name not in known):
                continue  # vLLM: an unknown name makes no call
            params = {m.group(1).strip(): self._value(name, m.group(1).strip(), m.group(2))
                      for m in _PAIR.finditer(body)}
            out.append(CallText(name, open_object(params, closed or final), closed))
        return out
