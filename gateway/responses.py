"""JSON for HTTP bodies, with orjson: every body the gateway writes (responses, SSE chunks, errors) goes
through `dumps`, and the bodies it parses itself through `loads`.

orjson is 15-30x faster than `json.dumps` on the bodies that matter (a 1,024-token chat response with
top-5 logprobs: bench/json_bodies.py), and this runs on the event loop that streams every other request.
Differences from the stdlib, all on the side of valid JSON: NaN and +-inf become null (as pydantic
writes them, which is how vLLM's bodies come out; `json.dumps` writes the non-JSON tokens `NaN`/`Infinity`,
and Starlette's JSONResponse refused them with a 500); numpy arrays and scalars serialise as lists and
numbers instead of raising; non-str keys become strings as `json.dumps` makes them. What orjson cannot hold
(an int beyond 64 bits) falls back to the stdlib, so no body that `json.dumps` could write fails here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
from starlette.responses import JSONResponse as _StarletteJSONResponse

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_NON_STR_KEYS = _OPTIONS | orjson.OPT_NON_STR_KEYS  # 40 % slower on every dict, so only when needed
_LONG_INT = re.compile(rb"\d{20}")  # may exceed 64 bits: orjson.loads would return a float for it


def dumps(obj: Any) -> bytes:
    """UTF-8 JSON, compact, not ASCII-escaped (what Starlette's JSONResponse wrote, but faster)."""
    try:
        return orjson.dumps(obj, option=_OPTIONS)
    except orjson.JSONEncodeError:
        pass
    try:  # a dict with int (or other non-str) keys somewhere
        return orjson.dumps(obj, option=_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        # beyond orjson (an int over 64 bits, an unsupported numpy layout): the stdlib, or its TypeError
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes | str) -> Any:
    """Parse a request body; raises ValueError (json.JSONDecodeError) on invalid JSON. Integers too
    long for 64 bits are parsed exactly (by the stdlib), never rounded to a float."""
    data = raw.encode("utf-8") if isinstance(raw, str) else raw
    if _LONG_INT.search(data):
        return json.loads(data)
    return orjson.loads(data)


class JSONResponse(_StarletteJSONResponse):
    """Starlette's JSONResponse (application/json, same arguments), rendered by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
