"""vLLM's `mistral` tool-call parser. Calls follow the content after [TOOL_CALLS], in one of the two forms
Mistral's tokenizers (mistral_common) write:

    v11 and later:  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}
                    (v11 may put [CALL_ID]abcDEF123 before [ARGS]; some models write name{...})
    before v11:     [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

As vLLM: call ids are 9 random letters and digits (Mistral's templates refuse others; a [CALL_ID] given by
the model is kept); v11 arguments are the first JSON value after the name, as written, text after it
dropped; the JSON-list form's arguments are re-serialised (json.dumps); the content before the calls is
stripped (here its trailing whitespace, as streamed). vLLM picks the form by the tokenizer's version; here
it is read off the text (a list or object right after the marker). A JSON list that does not parse leaves
the whole output as content (vLLM returns the text after the marker).
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

from gateway.tool_parsers.partial_json import loads_partial
from gateway.tool_parsers.sectioned import CallText, SectionedToolParser, first_json_value, stable_prefix

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits


def _list_call(obj: Any) -> CallText | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments")
    args = "{}" if args is None else args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return CallText(obj["name"], args)


class MistralToolParser(SectionedToolParser):
    name = "mistral"
    starts = (TOOL_CALLS,)
    strip_content = True

    def new_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def calls(self, region: str, final: bool) -> list[CallText]:
        body = region[len(TOOL_CALLS):].lstrip()
        if body[:1] in ("[", "{"):
            return self._json_calls(body, final)
        return [self._named_call(p, final) for p in region.split(TOOL_CALLS)[1:] if p.strip() or not final]

    def _json_calls(self, body: str, final: bool) -> list[CallText]:
        try:
            value, end = json.JSONDecoder().raw_decode(body)
            complete = True
        except ValueError:
            if final:
                return []
            try:
                value, _ = loads_partial(body, strings=False)
            except ValueError:
                return []
            complete = False
        items = value if isinstance(value, list) else [value]
        out = []
        for k, obj in enumerate(items):
            call = _list_call(obj) if isinstance(obj, dict) else None
            if call is None:
                if complete or k < len(items) - 1:
                    continue
                name = obj.get("name") if isinstance(obj, dict) else None
                out.append(CallText(name if isinstance(name, str) and name else None, "", False))
                break
            if not complete and k == len(items) - 1:  # the last item may still grow
                call = CallText(call.name, "", False)
            out.append(call)
        return out

    def _named_call(self, piece: str, final: bool) -> CallText:
        cuts = [i for i in (piece.find(ARGS), piece.find(CALL_ID), piece.find("{")) if i != -1]
        if not cuts:
            return CallText(piece.strip() or None if final else None, "{}" if final else "", final)
        name = piece[:min(cuts)].strip()
        rest = piece[min(cuts):]
        call_id = None
        if rest.startswith(CALL_ID):
            call_id, _, rest = rest[len(CALL_ID):].partition(ARGS)
            call_id = call_id.strip() or None
        rest = rest.removeprefix(ARGS)
        value, complete = first_json_value(rest)
        if complete or final:
            return CallText(name or None, value or "{}", True, call_id)
        return CallText(name or None, stable_prefix(rest, ()), False, call_id)
