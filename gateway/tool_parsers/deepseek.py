"""vLLM's `deepseek_v3` and `deepseek_v31` tool-call parsers (DeepSeek-V3 / R1, and DeepSeek-V3.1 / V3.2's
chat format). The calls follow the content between full-width-bar special tokens:

    deepseek_v3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                  ```json
                  {"city": "Paris"}
                  ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(each on one line; several calls in a row, `\\n`-separated in V3's template). As vLLM: the arguments are
the text the model wrote, not re-serialised; the content is the text before the first marker; only calls with their end
marker count in a whole output (a cut-off one is dropped; if none is left the output is content). Beyond
vLLM, whose whole-output patterns stop at a newline, arguments may span lines.
"""

from __future__ import annotations

from gateway.tool_parsers.sectioned import CallText, SectionedToolParser, stable_prefix

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekToolParser(SectionedToolParser):
    starts = (CALLS_BEGIN,)

    def _name_and_args(self, body: str) -> tuple[str | None, str | None]:
        """The name (None while incomplete) and the raw arguments text of a call's body so far."""
        raise NotImplementedError

    def calls(self, region: str, final: bool) -> list[CallText]:
        out = []
        for piece in region.split(CALL_BEGIN)[1:]:
            closed = CALL_END in piece
            body = piece.split(CALL_END, 1)[0]
            name, raw = self._name_and_args(body)
            if (final and not closed) or raw is None:
                name, raw = None, ""  # as vLLM: a call without its end marker (or its shape) is not a call
            args = raw.strip() if closed else stable_prefix(raw, self.arg_enders)
            out.append(CallText(name.strip() if name else None, args, closed))
        return out

    arg_enders: tuple[str, ...] = (CALL_END,)


class DeepSeekV3ToolParser(DeepSeekToolParser):
    name = "deepseek_v3"
    arg_enders = (FENCE_CLOSE + CALL_END,)

    def _name_and_args(self, body: str) -> tuple[str | None, str | None]:
        _, sep, rest = body.partition(SEP)
        name, nl, after = rest.partition("\n")
        if not sep or not nl:
            return None, ""
        if not after.startswith(FENCE_OPEN):  # the fence is not complete yet, or the call is not of this shape
            return (None, "") if FENCE_OPEN.startswith(after) else (name, None)
        return name, after[len(FENCE_OPEN):].removesuffix(FENCE_CLOSE)


class DeepSeekV31ToolParser(DeepSeekToolParser):
    name = "deepseek_v31"

    def _name_and_args(self, body: str) -> tuple[str | None, str | None]:
        name, sep, raw = body.partition(SEP)
        return (name, raw) if sep else (None, "")
