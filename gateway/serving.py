"""What the OpenAI endpoints (completions, chat, generate, responses) share before any engine request
runs: the served model's facts, and the per-app ServingContext that checks a request against the model's
limits and the server's flags, tokenizes prompts (big ones off the event loop) and shapes prompt logprobs;
plus the request-side helpers (request ids, per-choice seeds, prompt truncation). A choice's engine request
is gateway/choice_state.py (its text) and gateway/choice_runner.py (running them); the HTTP side of
streaming is gateway/sse.py.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from bus.control_state import PAUSED_MESSAGE, weights_discarded_message
from bus.messages import PromptLogprobs
from bus.sampling_params import ParamError, SamplingParams, tokenize_bad_words, validate_prompt_ids
from engine.config import EngineConfig
from gateway.engine_client import EngineClient
from gateway.errors import APIError, bad_request, engine_unavailable, model_not_found
from gateway.limits import Admission, Overloaded
from gateway.metrics import Metrics
from gateway.response_parts import clamp_logprob

THREAD_TOKENIZE_CHARS = 8_000  # ~3 ms of tokenizing: above this, a thread keeps the streams flowing


@dataclass
class ModelInfo:
    """What the gateway knows about the served model (from config.json and the flags)."""

    names: list[str]  # served names; the first is reported in responses
    root: str  # model folder
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    eos_token_ids: list[int] = field(default_factory=list)  # from the configs: what --tokens-only stops at


class ServingContext:
    """Everything a handler needs; one per app."""

    def __init__(self, cfg: EngineConfig, client: EngineClient, tokenizer: Any, model: ModelInfo,
                 metrics: Metrics, admission: Admission | None = None):
        """`tokenizer` is None with --tokens-only: nothing on the request path may touch one."""
        self.cfg, self.client, self.tokenizer, self.model, self.metrics = cfg, client, tokenizer, model, metrics
        self.admission = admission or Admission(cfg.gateway.max_num_queued_reqs, cfg.gateway.max_num_queued_tokens)
        self.eos_token_ids: list[int] = list(tokenizer.eos_token_ids if tokenizer is not None else model.eos_token_ids)
        self._token_strs: dict[int, str] = {}
        self.lora: Any = None  # gateway.lora_routes.LoraRegistry with --enable-lora

    def token_str(self, token_id: int) -> str:
        """The text of one token as logprobs report it (each id decoded alone, like vLLM); without a
        tokenizer, vLLM's `token_id:<id>` placeholder."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s

    # --- validation ----------------------------------------------------------------------------------

    def check_ready(self, model: str | None) -> str:
        """404 for a model we do not serve, 503 when the engine is dead; returns the name to report."""
        adapter = self.lora.ref(model) if self.lora is not None else None
        if model and model not in self.model.names and adapter is None:
            raise model_not_found(model)
        if not self.client.healthy:
            raise engine_unavailable(self.client.dead_reason)
        if self.client.rejecting_new_requests:
            raise engine_unavailable(PAUSED_MESSAGE)  # 503: retry after /resume
        state = self.client.control_state
        discarded = None if state.sleeping_tags else weights_discarded_message(  # asleep: queue
            state.weights_missing, state.weights_total, state.weight_version)
        if discarded:
            raise engine_unavailable(discarded)  # 503 until the weights are loaded again
        return adapter.name if adapter is not None else self.model.names[0]

    def with_lora(self, params: SamplingParams, model: str | None) -> SamplingParams:
        """The request's sampling parameters with the adapter its `model` names (vLLM: a LoRA by name)."""
        adapter = self.lora.ref(model) if self.lora is not None else None
        return params if adapter is None else params.replace(lora=adapter)

    def check_prompt_count(self, count: int, param: str) -> None:
        """--max-prompts-per-request, checked before anything is tokenised."""
        if count > self.cfg.gateway.max_prompts_per_request:
            raise bad_request(f"This request has {count} prompts; the server accepts at most "
                              f"{self.cfg.gateway.max_prompts_per_request} per request (--max-prompts-per-request)",
                              param)

    def check_prompt_tokens(self, total: int, param: str) -> None:
        """--max-prompt-tokens-per-request over all prompts of one request."""
        if total > self.cfg.gateway.max_prompt_tokens_per_request:
            raise self.too_many_prompt_tokens(param, total)

    def admit(self, request: Request, states: list[Any]) -> None:
        """--max-num-queued-reqs: reserve one slot per engine request; --max-num-queued-tokens: count the
        prompts as prefill backlog until their first output (503 + Retry-After beyond either)."""
        scope = request.scope
        try:
            self.admission.admit(scope, len(states), sum(len(s.prompt_ids) for s in states))
        except Overloaded as e:
            if e.reason:
                self.metrics.admission_rejections[e.reason].inc()
            raise
        for s in states:  # --max-num-queued-tokens: a prompt leaves the backlog with its first output
            s.on_first_output = functools.partial(self.admission.prefilled, scope, len(s.prompt_ids))

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            validate_prompt_ids(ids, self.model.vocab_size, param)
        except ParamError as e:
            raise bad_request(str(e), param) from None

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """vLLM: a request's return_tokens_as_token_ids, else the server's --return-tokens-as-token-ids."""
        return self.cfg.gateway.return_tokens_as_token_ids if requested is None else requested

    @property
    def default_chat_template_kwargs(self) -> dict[str, Any]:
        """--default-chat-template-kwargs (a request's chat_template_kwargs win key by key)."""
        return self.cfg.model.default_chat_template_kwargs

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str, prompt_param: str) -> int:
        """vLLM's context-length rule; returns the default max_tokens (the rest of the context)."""
        limit = self.model.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens. However, your "
                                  f"request has {prompt_len} input tokens. Please reduce the length of the "
                                  f"input messages.", prompt_param)
        elif prompt_len + requested > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in "
                              f"the completion). Please reduce the length of the messages or completion.", param)
        rest = max(limit - prompt_len, 1)  # vLLM: generation config's max_new_tokens caps a request's default
        return min(rest, int(self.model.sampling_defaults.get("max_tokens", rest)))

    def validate_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """The request's SamplingParams checked (ParamError naming the field), with its bad_words tokenized."""
        if params.bad_words:
            if self.tokenizer is None:
                raise ParamError("bad_words", "bad_words need the tokenizer, which a --tokens-only server does not "
                                              "load: ban token ids with logit_bias (-100) instead.")
            params = params.replace(bad_words_token_ids=tokenize_bad_words(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        params.validate(vocab_size=self.model.vocab_size, max_logprobs=self.cfg.model.max_logprobs)
        params.validate_routed_experts(prompt_len)
        params.validate_priority(self.cfg.scheduler.scheduling_policy)
        params.validate_trace(vocab_size=self.model.vocab_size, enabled=self.cfg.rl.enable_trace_replay)
        return params

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        """A streaming detokenizer for one choice; None without a tokenizer (the text stays empty)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.new_detokenizer(prompt_ids, skip_special_tokens=params.skip_special_tokens)

    def prompt_logprobs_json(self, prompt_ids: list[int], plp: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict (JSON keys are
        the ids) of the prompt token itself and the top alternatives, each {logprob, rank, decoded_token}."""
        if plp is None:
            return None
        out: list[Any] = [None]
        lps, ranks = plp.logprobs.tolist(), plp.ranks.tolist()
        ids, tops = plp.topk_ids.tolist(), plp.topk_logprobs.tolist()
        for i, (lp, rank) in enumerate(zip(lps, ranks)):
            tok = prompt_ids[i + 1]
            entry = {str(tok): self._logprob_entry(tok, lp, rank)}
            for j, (alt, alt_lp) in enumerate(zip(ids[i], tops[i])):
                entry.setdefault(str(alt), self._logprob_entry(alt, alt_lp, j + 1))
            out.append(entry)
        return out

    def _logprob_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        decoded = None if self.tokenizer is None else self.token_str(token_id)
        return {"logprob": clamp_logprob(logprob), "rank": rank, "decoded_token": decoded}

    def too_many_prompt_tokens(self, param: str, total: int | None = None) -> APIError:
        """--max-prompt-tokens-per-request's 400; `total` None when tokenising stopped at the limit."""
        limit = self.cfg.gateway.max_prompt_tokens_per_request
        held = f"{total} tokens" if total is not None else f"more than {limit} tokens"
        return bad_request(f"This request's prompts hold {held}; the server accepts at most {limit} per request "
                           f"(--max-prompt-tokens-per-request)", param)

    async def encode_many(self, texts: list[str], add_special_tokens: bool, *, budget: int | None = None,
                          keep: int | None = None, param: str = "prompt") -> list[list[int]]:
        """Tokenize prompts. Small inputs inline (the thread hop costs more than the work). Big ones go to
        a thread through `encode_batch`, which releases the GIL (plain `encode` holds it: measured, a
        thread would not unblock the loop), in batches of at most TOKENIZE_CHUNK_CHARS characters, so
        the loop runs between batches and the tokenizer's working memory (its Encoding objects hold
        ~100 bytes per token) stays bounded by the batch, not by the body. With `budget` (prompt tokens
        the request may still hold, counted after truncation to `keep`), tokenising stops with
        --max-prompt-tokens-per-request's 400 as soon as the prompts are known to exceed it: a body of
        text at the size limit costs the tokens of the budget, not of the body."""
        if sum(map(len, texts)) < THREAD_TOKENIZE_CHARS or not hasattr(self.tokenizer, "encode_batch"):
            return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        out = []
        held = 0
        for batch in _batches(texts, TOKENIZE_CHUNK_CHARS):
            if budget is not None and len(batch) == 1 and len(batch[0]) > TOKENIZE_CHUNK_CHARS and \
                    not (keep and keep > 0 and held + keep <= budget):
                # one text longer than a batch: count it piece by piece first (bounded memory, stops at
                # the budget); only a text that fits is then tokenised whole
                if await self._exceeds(batch[0], budget - held):
                    raise self.too_many_prompt_tokens(param)
            ids = await asyncio.to_thread(self.tokenizer.encode_batch, batch, add_special_tokens)
            held += _held(ids, keep)
            if budget is not None and held > budget:
                raise self.too_many_prompt_tokens(param)
            out += ids
        return out

    async def _exceeds(self, text: str, allowed: int) -> bool:
        """Whether `text` surely holds more than `allowed` tokens, from the tokens of its pieces (cut
        before whitespace, TOKENIZE_CHUNK_CHARS at most), stopping as soon as it does. A cut can change
        the tokens next to it (a tokenizer may start each piece with a word-start marker), so one token
        per piece is given away: never a false refusal, and the counting ends within a piece of it."""
        pieces, start, counted = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + TOKENIZE_CHUNK_CHARS)
            if end < len(text):
                cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                end = cut if cut > start else end
            piece = text[start:end]
            (ids,) = await asyncio.to_thread(self.tokenizer.encode_batch, [piece], False)
            pieces, counted, start = pieces + 1, counted + len(ids), end
            if counted - pieces > allowed:
                return True
        return False


TOKENIZE_CHUNK_CHARS = 1 << 18  # 256 K characters (~64 K tokens) per tokenizer call off the loop


def _batches(texts: list[str], max_chars: int) -> list[list[str]]:
    """Consecutive texts, at most `max_chars` characters a batch (a longer text alone)."""
    out: list[list[str]] = []
    size = 0
    for t in texts:
        if not out or size + len(t) > max_chars:
            out.append([])
            size = 0
        out[-1].append(t)
        size += len(t)
    return out


def _held(ids: list[list[int]], keep: int | None) -> int:
    """Tokens the prompts hold once truncated to `keep` (truncate_prompt_tokens; <= 0 or None: all)."""
    if keep and keep > 0:
        return sum(min(len(x), keep) for x in ids)
    return sum(map(len, ids))


def truncate_prompt(ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the whole context); with
    truncation_side "right", the first ones."""
    if not keep or keep <= 0:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]



def request_base_id(request: Request, body_request_id: str | None, new_id: Callable[[], str]) -> str:
    """vLLM: the X-Request-Id header, else the body's request_id, else a fresh id."""
    return request.headers.get("x-request-id") or body_request_id or new_id()


def child_seed(seed: int | None, i: int) -> int | None:
    """vLLM's seeds for the n samples of one prompt: seed + i (wrapped to 64 bits)."""
    if seed is None:
        return None
    return ((seed + i + 2**63) % 2**64) - 2**63
