"""vLLM's `kimi_k2` tool-call parser (Kimi-K2 Instruct / Thinking). Calls follow the content in a section:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

As vLLM: the header `functions.NAME:N` is the call's id (Kimi's chat template writes it back in the next
turn) and NAME its function; a header of another shape makes no call; the arguments are the JSON text as
written (stripped; `{}` when empty); a call cut off by the end of the output is kept with the arguments so
far; text after the section is dropped; whitespace-only content before the calls is dropped.
"""

from __future__ import annotations

import re

from gateway.tool_parsers.sectioned import CallText, SectionedToolParser, stable_prefix

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_HEADER = re.compile(r"(.+:\d+)")


class KimiK2ToolParser(SectionedToolParser):
    name = "kimi_k2"
    starts = (SECTION_BEGIN,)

    def calls(self, region: str, final: bool) -> list[CallText]:
        out = []
        for piece in region.split(CALL_BEGIN)[1:]:
            header, sep, raw = piece.partition(ARG_BEGIN)
            m = _HEADER.match(header.strip())
            if not m:
                if sep or final:
                    continue  # vLLM: no id, no call
                out.append(CallText(None, ""))
                break
            ends = [i for i in (raw.find(CALL_END), raw.find(SECTION_END)) if i != -1]
            closed = bool(ends) or final
            raw = raw[:min(ends)] if ends else raw
            if not sep:
                out.append(CallText(None, ""))
                break
            call_id = m.group(1)
            name = call_id.split(":")[0].removeprefix("functions.")
            args = (raw.strip() or "{}") if closed else stable_prefix(raw, (CALL_END, SECTION_END))
            out.append(CallText(name, args, closed, id=call_id))
        return out
