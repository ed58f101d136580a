"""`--reasoning-parser qwen3 | deepseek_r1`: split a chat output into reasoning and content, as vLLM's
parsers of those names do. Pure: text and token ids in, the two parts out.

Both models think between <think> and </think> (added tokens). As vLLM:
- `deepseek_r1`: the output may start without <think> (the template put it in the prompt); with no
  </think> at all, the whole output is reasoning.
- `qwen3`: the same, except that with the chat template variable `enable_thinking` false the whole output
  is content, and a <tool_call> ends the reasoning even without </think>.
- either: when the prompt's last think marker is </think> (the template closed the thinking, as Qwen3's
  does for enable_thinking false), the whole output is content; `qwen3` looks only at the current turn
  (after the last <|im_start|>), so the reasoning of earlier turns in a tool loop does not count.
The streamed pieces (`Split` deltas) concatenate to exactly the whole-output split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tool_parsers.base import partial_tag_overlap

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

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        vocab_ids = [tokenizer.token_to_id(t) for t in (THINK_START, THINK_END)]
        if None in vocab_ids:
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
            return Split(body, None)
        reasoning, content = body[:end], body[end + len(marker):]
        return Split(reasoning or None, content or None)

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
            ready = len(body) - hold
            out, self._sent = body[self._sent:ready], max(self._sent, ready)
            return Split(out or None, None)
        self._ended_at = body_from + end + len(marker)
        reasoning = body[self._sent:end]
        self._sent = end
        content = self._text[self._ended_at:]
        return Split(reasoning or None, content or None)

    def finish(self) -> Split:
        """At the end of the stream: reasoning text held back as a possible marker prefix."""
        if not self.thinking or self._ended_at is not None:
            return Split(None, None)
        body = self._text.partition(THINK_START)[2] if THINK_START in self._text else self._text
        out, self._sent = body[self._sent:], len(body)
        return Split(out or None, None)


def _may_become(text: str, tag: str) -> bool:
    return tag.startswith(text)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)
    turn_boundaries = ("<|im_start|>", "<|im_end|>")  # earlier turns' </think> do not end this one

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._implicit_end_ids = {tokenizer.token_to_id(t) for t in self.implicit_ends} - {None}

    def _thinking(self, kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("enable_thinking", True))

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """vLLM's qwen3 count: the output starts in the reasoning (when thinking is on), which the first
        </think> or <tool_call> ends; <think> markers are not counted."""
        if not self.thinking:
            return 0
        count = 0
        for t in token_ids:
            if t == self.end_id or t in self._implicit_end_ids:
                break
            if t != self.start_id:
                count += 1
        return count


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1ReasoningParser,
                                                       "qwen3": Qwen3ReasoningParser}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class of a --reasoning-parser name; ValueError listing the available ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"invalid reasoning parser: {name} (choose from {{ {','.join(REASONING_PARSERS)} }})") \
            from None
