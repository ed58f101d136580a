"""`--reasoning-parser`: split a chat output into reasoning and content, as vLLM's parsers of the same
names do. Pure: text and token ids in, the two parts out. (`openai_gptoss` reads gpt-oss's harmony channels
with gateway/tool_parsers/harmony.py.)

Both models think between <think> and </think> (added tokens). As vLLM:
- `deepseek_r1`: the output may start without <think> (the template put it in the prompt); with no
  </think> at all, the whole output is reasoning.
- `qwen3`: the same, except that with the chat template variable `enable_thinking` false the whole output
  is content, and a <tool_call> ends the reasoning even without </think>.
- either: when the prompt's last think marker is </think> (the template closed the thinking, as Qwen3's
  does for enable_thinking false), the whole output is content; `qwen3` looks only at the current turn
  (after the last <|im_start|>), so the reasoning of earlier turns in a tool loop does not count.
- `deepseek_v3`: `deepseek_r1` when the chat template variable `thinking` (or `enable_thinking`) is true, else
  the whole output is content (DeepSeek-V3.1's template thinks only when asked).
- `kimi_k2` and `glm45`: the output starts in the reasoning unless `thinking` / `enable_thinking` is false
  (Kimi-K2-Thinking, GLM-4.5 / 4.6 / 4.7); a tool-call marker ends it without </think>; trailing whitespace
  of the reasoning is dropped; `glm45` reads the prompt's current turn only (after the last <|user|>,
  <|assistant|>, <|system|> or <|observation|>).
The streamed pieces (`Split` deltas) concatenate to exactly the whole-output split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tool_parsers.base import partial_tag_overlap
from gateway.tool_parsers.harmony import HarmonyOutput, count_reasoning_tokens

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str | None
    content: str | None


class ReasoningParser:
    """One per choice: `split` for a whole output, `feed` for each streamed text delta."""

    name = ""
    implicit_ends: tuple[str, ...] = ()  # text that ends the reasoning without </think> (kept as content)
    turn_boundaries: tuple[str, ...] = ()  # the prompt is read back to the last of these only
    needs_think_tokens = True  # refuse a tokenizer without <think> / </think> tokens
    strip_trailing_whitespace = False  # vLLM's engine parsers drop the reasoning's trailing whitespace

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        vocab_ids = [tokenizer.token_to_id(t) for t in (THINK_START, THINK_END)]
        if None in vocab_ids and self.needs_think_tokens:
            raise ValueError(f"--reasoning-parser {self.name}: the tokenizer has no {THINK_START} / {THINK_END} "
                             "tokens")
        self.start_id, self.end_id = vocab_ids
        self._boundary_ids = {tokenizer.token_to_id(t) for t in self.turn_boundaries} - {None}
        self.thinking = self._thinking(chat_template_kwargs or {})
        self._text = ""  # streamed so far
        self._sent = 0  # how much of the reasoning part was sent
        self._ended_at: int | None = None  # where content starts in _text, once known

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        return True

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        """vLLM's adjust_request: markers that are special tokens must reach the parser."""
        return skip

    def prompt_ends_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """vLLM's is_reasoning_end on the prompt: its last think marker (in the current turn, for parsers
        with turn boundaries) is </think>."""
        for t in reversed(prompt_ids):
            if t == self.start_id or t in self._boundary_ids:
                return False
            if t == self.end_id:
                return True
        return False

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Before the first delta: a prompt that ends the reasoning makes the output content."""
        if not self.thinking or self.prompt_ends_reasoning(prompt_ids):
            self.thinking = False

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """vLLM's count_reasoning_tokens (usage.completion_tokens_details.reasoning_tokens): tokens inside
        <think>...</think>, nesting counted, the markers not."""
        count = depth = 0
        for t in token_ids:
            if t == self.start_id:
                depth += 1
            elif t == self.end_id:
                depth = max(0, depth - 1)
            elif depth:
                count += 1
        return count

    def split(self, text: str) -> Split:
        if not self.thinking:
            return Split(None, text)
        body = text.partition(THINK_START)[2] if THINK_START in text else text
        end, marker = self._end(body)
        if end is None:
            return Split(self._trim(body) or None, None)
        reasoning, content = self._trim(body[:end]), body[end + len(marker):]
        return Split(reasoning or None, content or None)

    def _trim(self, reasoning: str) -> str:
        return reasoning.rstrip() if self.strip_trailing_whitespace else reasoning

    def _end(self, body: str) -> tuple[int | None, str]:
        """Where the reasoning ends in `body` and the marker there ("" for an implicit end, kept as content)."""
        best: tuple[int | None, str] = (None, "")
        i = body.find(THINK_END)
        if i != -1:
            best = (i, THINK_END)
        for tag in self.implicit_ends:
            j = body.find(tag)
            if j != -1 and (best[0] is None or j < best[0]):
                best = (j, "")
        return best

    def feed(self, delta_text: str) -> Split:
        """The next delta's reasoning and content. Text that may still become a marker is held back."""
        if not self.thinking:
            return Split(None, delta_text or None)
        self._text += delta_text
        if self._ended_at is not None:
            return Split(None, delta_text or None)
        body_from = self._text.find(THINK_START) + len(THINK_START) if THINK_START in self._text else 0
        if body_from == 0 and _may_become(self._text, THINK_START) and len(self._text) < len(THINK_START):
            return Split(None, None)
        body = self._text[body_from:]
        end, marker = self._end(body)
        if end is None:
            hold = max([partial_tag_overlap(body, t) for t in (THINK_END, *self.implicit_ends)])
            ready = len(self._trim(body[:len(body) - hold]))  # trailing whitespace waits for more reasoning
            out, self._sent = body[self._sent:ready], max(self._sent, ready)
            return Split(out or None, None)
        self._ended_at = body_from + end + len(marker)
        reasoning = body[self._sent:len(self._trim(body[:end]))]
        self._sent = end
        content = self._text[self._ended_at:]
        return Split(reasoning or None, content or None)

    def finish(self) -> Split:
        """At the end of the stream: reasoning text held back as a possible marker prefix."""
        if not self.thinking or self._ended_at is not None:
            return Split(None, None)
        body = self._text.partition(THINK_START)[2] if THINK_START in self._text else self._text
        out, self._sent = self._trim(body)[self._sent:], len(body)
        return Split(out or None, None)


def _may_become(text: str, tag: str) -> bool:
    return tag.startswith(text)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(ReasoningParser):
    """vLLM's deepseek_v3: deepseek_r1 when the template was asked to think, else all content."""

    name = "deepseek_v3"

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        return super().count_tokens(token_ids) if self.thinking else 0


class OpenStartReasoningParser(ReasoningParser):
    """The output starts in the reasoning (the template opened it), which the first </think> or an implicit
    end closes."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._implicit_end_ids = {tokenizer.token_to_id(t) for t in self.implicit_ends} - {None}

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """vLLM's count: the output starts in the reasoning (when thinking is on), which the first
        </think> or implicit end closes; <think> markers are not counted."""
        if not self.thinking:
            return 0
        count = 0
        for t in token_ids:
            if t == self.end_id or t in self._implicit_end_ids:
                break
            if t != self.start_id:
                count += 1
        return count


class Qwen3ReasoningParser(OpenStartReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)
    turn_boundaries = ("<|im_start|>", "<|im_end|>")  # earlier turns' </think> do not end this one

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("enable_thinking", True))


class _ThinkingSwitch(OpenStartReasoningParser):
    """vLLM's engine parsers (kimi_k2, glm45): thinking unless `thinking` or `enable_thinking` says no (either
    true wins); markers may be special tokens; trailing whitespace of the reasoning is dropped."""

    needs_think_tokens = False  # vLLM matches the markers as text too
    strip_trailing_whitespace = True

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        flags = [kwargs.get(k) for k in ("thinking", "enable_thinking")]
        return True if flags == [None, None] else any(bool(f) for f in flags)

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False


class KimiK2ReasoningParser(_ThinkingSwitch):
    name = "kimi_k2"
    implicit_ends = ("<|tool_calls_section_begin|>",)


class Glm45ReasoningParser(_ThinkingSwitch):
    name = "glm45"
    implicit_ends = ("<tool_call>",)
    turn_boundaries = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


class HarmonyReasoningParser(ReasoningParser):
    """`openai_gptoss`: the analysis channel is the reasoning. The chat path (gateway/chat_parsing.py) reads
    the whole harmony output with one HarmonyOutput when either harmony parser is set; alone, this class
    gives the reasoning and the content (final and commentary messages)."""

    name = "openai_gptoss"
    needs_think_tokens = False

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.tokenizer = tokenizer
        self._stream = HarmonyOutput(reasoning=True, tools=False)

    def adjust_skip_special_tokens(self, skip: bool) -> bool:
        return False

    def start(self, prompt_ids: Sequence[int]) -> None:
        return None  # vLLM: the prompt does not end gpt-oss's reasoning

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        return count_reasoning_tokens(self.tokenizer, token_ids)

    def split(self, text: str) -> Split:
        reasoning, content, _ = HarmonyOutput(reasoning=True, tools=False).parse(text)
        return Split(reasoning, content)

    def feed(self, delta_text: str) -> Split:
        d = self._stream.feed(delta_text, finished=False)
        return Split(d.reasoning, d.content)

    def finish(self) -> Split:
        d = self._stream.feed("", finished=True)
        return Split(d.reasoning, d.content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,  # DeepSeek-V3.1 / V3.2 (thinking when asked)
    "glm45": Glm45ReasoningParser,  # GLM-4.5 / 4.6 / 4.7 (vLLM's glm47 engine)
    "kimi_k2": KimiK2ReasoningParser,  # Kimi-K2-Thinking
    "openai_gptoss": HarmonyReasoningParser,  # gpt-oss: the harmony analysis channel
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class of a --reasoning-parser name; ValueError listing the available ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"invalid reasoning parser: {name} (choose from {{ {','.join(REASONING_PARSERS)} }})") \
            from None
