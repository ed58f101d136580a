"""One chat choice's output -> reasoning, content and tool calls, whole or streamed: the reasoning parser
first, then the tool-call parser on the part after the reasoning only (vLLM's DelegatingParser, with the
serving layer's rules for tool_choice, parallel_tool_calls and finish_reason). Pure: no I/O.

Tool calls are parsed only for tool_choice "auto" on a server started with --enable-auto-tool-choice
(tool_choice "none" renders the tools and returns the output as content). The streamed deltas
concatenate to the whole-output result: content, reasoning and each call's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.reasoning_parsers import HarmonyReasoningParser, ReasoningParser, reasoning_parser_class
from gateway.tool_parsers import tool_parser_class
from gateway.tool_parsers.base import Delta, DeltaToolCall, Extracted, ToolCall, ToolParser
from gateway.tool_parsers.harmony import HarmonyOutput, HarmonyToolParser

log = structlog.get_logger()


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ParserConfig:
    """The server's parsers (names as the flags give them) and the request's choices that steer them."""

    tool_parser: str | None = None  # set only with --enable-auto-tool-choice
    reasoning_parser: str | None = None
    tool_choice_auto: bool = False  # "auto" with tools
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # the request's (schemas type some parsers' arguments)

    @property
    def active(self) -> bool:
        harmony = self.tool_parser == HarmonyToolParser.name  # gpt-oss's output is always read by channel
        return bool(self.reasoning_parser) or harmony or (bool(self.tool_parser) and self.tool_choice_auto)


def finish_reason(engine_reason: str | None, tools_called: bool) -> str:
    """vLLM: "tool_calls" when the choice carries calls and the model stopped by itself."""
    reason = engine_reason or "stop"
    return "tool_calls" if tools_called and reason == "stop" else reason


class ChatOutputParser:
    """One per choice (the streaming path keeps state)."""

    def __init__(self, cfg: ParserConfig, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.cfg = cfg
        self.reasoning: ReasoningParser | None = None
        if cfg.reasoning_parser:
            self.reasoning = reasoning_parser_class(cfg.reasoning_parser)(tokenizer, cfg.chat_template_kwargs)
            self.reasoning.start(prompt_ids)
        self.tools: ToolParser | None = None
        if cfg.tool_parser and cfg.tool_choice_auto:
            self.tools = tool_parser_class(cfg.tool_parser)(tokenizer, cfg.tools)
        self.harmony: HarmonyOutput | None = None  # gpt-oss: one reader of the channels for both parsers
        if isinstance(self.reasoning, HarmonyReasoningParser) or cfg.tool_parser == HarmonyToolParser.name:
            self.harmony = HarmonyOutput(reasoning=self.reasoning is not None, tools=self.tools is not None)
        self._tool_text = ""  # the streamed text after the reasoning
        self._blank = ""  # whitespace-only content held back (_hold_blank)
        self._content_sent = False  # whether content other than whitespace was sent
        self.tools_streamed = False

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        return self.reasoning.count_tokens(token_ids) if self.reasoning is not None else 0

    def skip_special_tokens(self, skip: bool) -> bool:
        if self.harmony is not None:
            return False
        for parser in (self.reasoning, self.tools):
            skip = parser.adjust_skip_special_tokens(skip) if parser is not None else skip
        return skip

    # ------------------------------------------------------------------ whole output

    def parse(self, text: str) -> ParsedMessage:
        if self.harmony is not None:
            assert self.reasoning is None or isinstance(self.reasoning, HarmonyReasoningParser)
            reasoning, content, calls = HarmonyOutput(self.harmony.reasoning, self.harmony.tools).parse(text)
            calls = calls[:1] if not self.cfg.parallel_tool_calls else calls
            return ParsedMessage(reasoning if self.cfg.include_reasoning else None, content, calls)
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCall] = []
        if self.tools is not None:
            try:
                found = self.tools.extract(content or "")
            except Exception as e:  # noqa: BLE001 - as vLLM: an output the parser cannot read stays content
                log.warning("gateway.tool_parser_failed", parser=self.cfg.tool_parser, exc_info=e)
                found = Extracted([], content)
            if found.tools_called:
                calls, content = found.calls, found.content
                if content is not None and not content.strip():
                    content = None
        if not self.cfg.parallel_tool_calls:
            calls = calls[:1]
        return ParsedMessage(reasoning if self.cfg.include_reasoning else None, content, calls)

    # ------------------------------------------------------------------ stream

    def parse_delta(self, delta_text: str, finished: bool) -> Delta | None:
        """What this delta adds (None: nothing to send yet). At `finished`, held-back text is flushed."""
        if self.harmony is not None:
            out = self.harmony.feed(delta_text, finished)
        else:
            out = self._delta(delta_text, finished)
        filtered = False
        if out.tool_calls:
            self.tools_streamed = True
            if not self.cfg.parallel_tool_calls:
                kept = [c for c in out.tool_calls if c.index == 0]
                filtered, out.tool_calls = len(kept) < len(out.tool_calls), kept
        if not self.cfg.include_reasoning:
            out.reasoning = None
        if out.empty() and not filtered:  # vLLM: a step whose calls were all filtered out still sends {}
            return None
        return out

    def _delta(self, delta_text: str, finished: bool) -> Delta:
        out = Delta()
        after = delta_text
        if self.reasoning is not None:
            split = self.reasoning.feed(delta_text)
            if finished:
                rest = self.reasoning.finish()
                split.reasoning = (split.reasoning or "") + (rest.reasoning or "") or None
            out.reasoning, after = split.reasoning, split.content or ""
        if self.tools is None:
            out.content = after or None
        elif after or finished:
            previous = self._tool_text
            self._tool_text += after
            try:
                got = self.tools.extract_streaming(previous, self._tool_text, after) if after else None
            except Exception as e:  # noqa: BLE001 - as vLLM: the step sends nothing, the stream goes on
                log.warning("gateway.tool_parser_failed", parser=self.cfg.tool_parser, exc_info=e)
                got = None
            if got is not None:
                out.content, out.tool_calls = got.content, got.tool_calls
            if finished:
                self._finish_tools(out)
            out.content = self._hold_blank(out.content, bool(out.tool_calls), finished)
        return out

    def _hold_blank(self, content: str | None, calls: bool, finished: bool) -> str | None:
        """While all the content so far is whitespace, it is held until text follows (sent with it) or a call
        does (dropped: the whole-output result has no content then), so the stream reassembles to it.
        (vLLM streams such whitespace and drops it from the whole result only.)"""
        text = self._blank + (content or "")
        self._blank = ""
        if self._content_sent or text.strip():
            self._content_sent = True
            return text or None
        if calls or self.tools_streamed:
            return None
        if finished:
            return text or None
        self._blank = text
        return None

    def _finish_tools(self, out: Delta) -> None:
        """vLLM's finalize: argument text parsed but not yet sent goes with the last call's delta. Beyond
        vLLM, content held back as a possible start of a call marker is sent, as the whole output has it."""
        assert self.tools is not None
        rest = self.tools.remaining_arguments()
        if out.tool_calls:
            last = out.tool_calls[-1]
            last.arguments = (last.arguments or "") + rest
        elif rest:  # beyond vLLM, which sends the rest only with a delta that has calls: it would be lost
            out.tool_calls = [DeltaToolCall(len(self.tools.prev_calls) - 1, arguments=rest)]
        held = self.tools.unsent_content(self._tool_text)
        if held:
            out.content = (out.content or "") + held

    def finish_reason(self, engine_reason: str | None, whole: ParsedMessage | None = None) -> str:
        called = bool(whole.tool_calls) if whole is not None else self.tools_streamed
        return finish_reason(engine_reason, called)
