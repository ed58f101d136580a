"""What /v1/completions and /v1/chat/completions share: prompt validation against the model's limits,
turning engine output deltas into text (stop strings live here: the engine only knows token ids),
running the n x prompts engine requests of one HTTP request concurrently, and aborting them when the
client goes away.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from bus.control_state import PAUSED_MESSAGE, version_label, weights_discarded_message
from bus.messages import ErrorInfo, ErrorKind, PromptLogprobs, RequestOutput
from bus.sampling_params import ParamError, SamplingParams, tokenize_bad_words, validate_prompt_ids
from engine import routed_experts
from engine.config import EngineConfig
from gateway.dp_middleware import requested_engine
from gateway.engine_client import DuplicateRequest, EngineClient, EngineDead
from gateway.errors import (
    BAD_REQUEST,
    INTERNAL,
    APIError,
    api_error_from,
    bad_request,
    engine_unavailable,
    model_not_found,
)
from gateway.limits import Admission, Overloaded
from gateway.metrics import Metrics
from gateway.request_log import log_request
from gateway.responses import dumps

log = structlog.get_logger()
T = TypeVar("T")
MAX_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps to this
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


# --- one engine request --------------------------------------------------------------------------


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


# --- many engine requests of one HTTP request ----------------------------------------------------


class _Done:
    pass


@dataclass
class _Failed:
    error: APIError


def engine_failure(ctx: ServingContext, error: ErrorInfo | None) -> APIError:
    """The HTTP error of a request the engine ended with an error: 503 while the engine is down, the
    status the engine gave when it knew one (503 when paused between our check and the scheduler's, or
    queued during a level-2 sleep and woken without weights), else a 500 with the engine's message."""
    message = error.message if error is not None else None
    if not ctx.client.healthy:
        return engine_unavailable(ctx.client.dead_reason or message)
    if error is not None and error.status == 503:
        return engine_unavailable(error.message)
    if error is not None and error.status is not None:
        return APIError(error.message, status=error.status, type=BAD_REQUEST if error.status < 500 else INTERNAL,
                        param=error.param)
    return APIError(message or "the engine failed this request", status=500, type=INTERNAL)


async def _run_choice(ctx: ServingContext, state: ChoiceState, sink: asyncio.Queue) -> None:
    if ctx.cfg.gateway.enable_log_requests:
        log_request(state.request_id, state.prompt_ids, state.params, ctx.cfg.gateway.max_log_len)
    try:
        gen = ctx.client.generate(state.request_id, state.prompt_ids, state.params, ctx.eos_token_ids,
                                  engine=state.engine)
        async with aclosing(gen):  # leaving early closes it, which aborts the engine request
            async for out in gen:
                if state.on_first_output is not None:
                    state.on_first_output()
                    state.on_first_output = None
                update = state.feed(out)
                ctx.metrics.observe_delta(state, update)
                sink.put_nowait(update)
                if state.finished:
                    break
        if state.finish_reason == "error":
            raise engine_failure(ctx, state.error)
        if not state.finished:
            raise engine_failure(ctx, ErrorInfo(ErrorKind.UNFINISHED,
                                                "the engine ended the request without finishing it"))
    except asyncio.CancelledError:
        raise
    except EngineDead as e:
        sink.put_nowait(_Failed(engine_unavailable(str(e))))
    except DuplicateRequest:
        sink.put_nowait(_Failed(bad_request(f"request id {state.request_id!r} is already running", "request_id")))
    except Exception as e:
        if not isinstance(e, APIError):
            log.error("gateway.choice_failed", request_id=state.request_id, exc_info=e)
        sink.put_nowait(_Failed(api_error_from(e)))
    finally:
        ctx.metrics.observe_choice(state)
        sink.put_nowait(_Done())


async def run_choices(ctx: ServingContext, states: list[ChoiceState]) -> AsyncIterator[ChoiceUpdate]:
    """Run every choice's engine request concurrently; yield their updates as they come. The first
    failure raises (APIError) and, like a client going away, aborts the requests still running."""
    sink: asyncio.Queue = asyncio.Queue()
    try:  # one engine for all of a request's choices: they share its prefix cache
        engine = ctx.client.pick_engine(requested_engine.get(), [
            (s.request_id, len(s.prompt_ids) + (s.params.max_tokens or 0)) for s in states])
    except EngineDead as e:
        raise engine_unavailable(str(e)) from None
    for s in states:
        s.engine = engine
    tasks = [asyncio.create_task(_run_choice(ctx, s, sink)) for s in states]
    try:
        remaining = len(tasks)
        while remaining:
            item = await sink.get()
            if isinstance(item, _Done):
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.client.release([s.request_id for s in states])


# --- client disconnects ---------------------------------------------------------------------------


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """text/event-stream that stops producing (closing the body generator, which aborts the engine
    requests) as soon as the client disconnects, on every ASGI spec version."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.body_iterator) as body:  # type: ignore[type-var]
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, produce())
        except (ClientDisconnected, OSError):
            log.debug("gateway.client_disconnected", path=scope.get("path"))


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON chunk."""
    return b"data: " + dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE framing plus vLLM's stream error contract: an error chunk, then [DONE]."""
    try:
        async with aclosing(chunks) as it:  # type: ignore[type-var]
            async for chunk in it:
                yield sse(chunk)
    except Exception as e:
        err = api_error_from(e)
        if err.status >= 500 and not isinstance(e, APIError):
            log.error("gateway.stream_failed", exc_info=e)
        yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}})
    yield SSE_DONE


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}
    u["prompt_tokens_details"] = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    return u


def clamp_logprob(x: float) -> float:
    """vLLM: -inf (and NaN) become -9999.0, which JSON can carry."""
    return MAX_LOGPROB_FLOOR if math.isnan(x) else max(MAX_LOGPROB_FLOOR, x)


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


def request_base_id(request: Request, body_request_id: str | None, new_id: Callable[[], str]) -> str:
    """vLLM: the X-Request-Id header, else the body's request_id, else a fresh id."""
    return request.headers.get("x-request-id") or body_request_id or new_id()


async def collect(ctx: ServingContext, states: list[ChoiceState]) -> None:
    """Run every choice to the end (non-streaming responses read the states afterwards)."""
    async with aclosing(run_choices(ctx, states)) as updates:  # type: ignore[type-var]
        async for _ in updates:
            pass


def child_seed(seed: int | None, i: int) -> int | None:
    """vLLM's seeds for the n samples of one prompt: seed + i (wrapped to 64 bits)."""
    if seed is None:
        return None
    return ((seed + i + 2**63) % 2**64) - 2**63
