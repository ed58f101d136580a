"""One choice of a response (= one engine request) as its deltas arrive: the text (detokenized, stop strings
applied: the engine only knows token ids, with the text that could still become a stop string held back
so streamed text never has to be taken back), and what the request asked to get back about its tokens
(logprobs, ranks, sampling mass and mask, weight-version spans, routed experts). Pure: no sockets."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus.control_state import version_label
from bus.messages import ErrorInfo, PromptLogprobs, RequestOutput
from bus.sampling_params import SamplingParams
from engine import routed_experts


def find_stop(text: str, new_from: int, stops: list[str], include: bool) -> tuple[int, str] | None:
    """Earliest stop string that ends after `new_from`; returns (where to cut the text, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return (i + len(s) if include else i), s


@dataclass
class ChoiceUpdate:
    """What one engine delta adds to one choice, ready to be shaped into a chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[list[float]]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    text_offset: int  # where `text` starts in the choice's whole text
    ranks: list[int] | None = None
    sampling_mass: list[float] | None = None
    sampling_mask: tuple[Any, Any] | None = None  # this update's (ids, counts) (engine/sampling_mask.py)


class ChoiceState:
    """One choice (= one engine request): detokenizes deltas, applies stop strings, and holds back
    text that could still become a stop string, so streamed text never has to be taken back."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: Any, prefix: str = "", hide_output: bool = False):
        """`detokenizer` None: no text (--tokens-only). `hide_output`: the generated tokens' text is not
        part of the choice's text (vLLM's echo with max_tokens 0)."""
        self.index, self.request_id, self.prompt_ids, self.params = index, request_id, prompt_ids, params
        self.detok = detokenizer
        self.hide_output = hide_output
        self.stops = list(params.stop)
        self.include = params.include_stop_str_in_output
        self.holdback = 0 if self.include or not self.stops else max(map(len, self.stops)) - 1
        self.text = prefix  # echo puts the prompt text here
        self.sent = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[list[float]]] = []
        self.ranks: list[int] = []
        self.sampling_mass: list[float] = []
        self.mask_pieces: list[tuple[Any, Any]] = []  # --return-sampling-mask: (ids, counts) per output
        self.prompt_logprobs: PromptLogprobs | None = None
        self.routed_pieces: list[routed_experts.Piece] = []  # MoE router capture; see routed_experts_b64
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: ErrorInfo | None = None
        self.num_cached_tokens = 0
        self.admitted = False  # an engine output came back (metrics record the prefix-cache lookup then)
        self.engine = 0  # the data-parallel engine it runs on (run_choices; the engine label of /metrics)
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None  # when the first delta with tokens arrived
        self.last_token_at: float | None = None  # ... and the latest one
        self.gap: float | None = None  # seconds from the previous delta with tokens to the latest (None: first)
        self.spans: list[list] = []  # [epoch, start, end, stale_kv] over output token indices
        self.on_first_output: Callable[[], None] | None = None  # set by admission (gateway.limits)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def weight_versions(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Half-open spans of output tokens per weight version (vLLM's `weight_versions`); a span whose
        tokens were computed on KV from older weights (keep pause, clear_cache=false) says stale_kv."""
        out = []
        for epoch, start, end, stale in self.spans:
            span: dict[str, Any] = {"version": version_label(state, epoch), "start": start, "end": end}
            if self.params.lora is not None:  # the adapter version that computed them (gateway/lora_routes.py)
                span["lora_name"], span["lora_version"] = self.params.lora.name, self.params.lora.version
            if stale:
                span["stale_kv"] = True
            out.append(span)
        return out

    def feed(self, out: RequestOutput, now: float | None = None) -> ChoiceUpdate:
        """Take one engine delta (arrived at `now`, time.monotonic() by default)."""
        new = list(out.token_ids)
        if new:
            now = time.monotonic() if now is None else now
            if self.last_token_at is None:
                self.first_token_at = now
            else:
                self.gap = now - self.last_token_at
            self.last_token_at = now
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if new:
            n0 = len(self.token_ids)
            last = self.spans[-1] if self.spans else None
            if last and last[0] == out.weight_epoch and last[3] == out.stale_kv and last[2] == n0:
                last[2] += len(new)
            else:
                self.spans.append([out.weight_epoch, n0, n0 + len(new), out.stale_kv])
        self.token_ids += new
        if out.logprobs is not None:
            self.logprobs += out.logprobs
        if out.top_logprobs is not None:
            self.top_logprobs += out.top_logprobs
        if out.ranks is not None:
            self.ranks += out.ranks
        if out.sampling_mass is not None:
            self.sampling_mass += out.sampling_mass
        mask = None
        if out.sampling_mask_counts is not None:
            mask = (out.sampling_mask_ids, out.sampling_mask_counts)
            self.mask_pieces.append(mask)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.routed_experts is not None:
            self.routed_pieces.append((out.routed_experts_start, out.routed_experts))
        text_ids = new
        if out.finished and out.finish_reason == "stop" and new and not self.include:
            text_ids = new[:-1]  # the EOS / stop token's text is not part of the output (vLLM)
        before = len(self.text)
        if text_ids and self.detok is not None and not self.hide_output:
            self.text += self.detok.push(text_ids)
        if self.stops and len(self.token_ids) > self.params.min_tokens and len(self.text) > before:
            hit = find_stop(self.text, before, self.stops, self.include)
            if hit is not None:
                self.text = self.text[:hit[0]]
                self.finish_reason, self.stop_reason = "stop", hit[1]
        if out.finished and self.finish_reason is None:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason or "stop", out.stop_reason, out.error
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.holdback)
        start, self.sent = self.sent, end
        return ChoiceUpdate(self.index, self.text[start:end], new, out.logprobs, out.top_logprobs,
                            self.finish_reason, self.stop_reason, start, out.ranks, out.sampling_mass, mask)


def routed_experts_rows(state: ChoiceState):
    """The router's top-k of a choice, [num_tokens - 1 - routed_experts_prompt_start, num_moe_layers, top_k]
    from the prompt position routed_experts_prompt_start on, prompt and generated tokens but the last (never
    forwarded); None when the engine sent none: the flag is off, the model is dense, or the request ended
    before any forward pass. An aborted request has the positions computed until then."""
    pieces = state.routed_pieces
    if not pieces:
        return None
    hi = min(routed_experts.end(pieces), len(state.prompt_ids) + len(state.token_ids) - 1)
    lo = min(state.params.routed_experts_prompt_start, hi)
    return routed_experts.assemble(pieces, lo, hi)


def routed_experts_b64(state: ChoiceState) -> str | None:
    """vLLM's `routed_experts` of a choice: base64 of a `.npy` file (np.save, no pickle) of
    routed_experts_rows."""
    rows = routed_experts_rows(state)
    return None if rows is None else routed_experts.to_b64(rows)
