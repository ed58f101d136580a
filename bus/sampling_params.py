"""Sampling parameters: one typed record, built and validated once at the edge (the gateway), and sent
as it is (a msgspec Struct, see bus/messages.py) to the scheduler and the workers.

Names and defaults follow vLLM's SamplingParams so requests port unchanged. Validation raises
ParamError naming the offending field; the gateway turns that into a 400.
"""

from __future__ import annotations

import math

import msgspec


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """vLLM's StructuredOutputsParams: exactly one constraint on the output (the gateway builds it from
    `structured_outputs`, `response_format`, the `guided_*` aliases or a forced tool choice;
    docs/structured-outputs.md). `json` is the JSON Schema as JSON text, so it travels typed."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF (llguidance reads both)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def validate(self) -> None:
        """vLLM's shape rules (sampling_params._validate_structured_outputs and __post_init__); whether the
        constraint compiles is engine.structured_outputs.check_compiles."""
        p = "structured_outputs"
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        _check(len(given) <= 1, p, "You can only use one kind of structured outputs constraint but multiple are "
                                   f"specified: {', '.join(given)}")
        _check(len(given) == 1, p, "You must use one kind of structured outputs constraint but none are specified")
        _check(self.choice is None or len(self.choice) > 0, f"{p}.choice", "Choice '[]' cannot be an empty list")
        _check(self.grammar is None or self.grammar.strip() != "", f"{p}.grammar",
               "structured_outputs.grammar cannot be an empty string")
        _check(self.json is None or self.json.strip() != "", f"{p}.json",
               "structured_outputs.json cannot be an empty string")
        _check(self.json_object is not False, f"{p}.json_object", "structured_outputs.json_object must be True if "
                                                                 "set; omit structured_outputs to disable structured "
                                                                 "outputs")
        _check(self.regex is None or "\x00" not in self.regex, f"{p}.regex",
               "structured_outputs.regex must not contain a NUL character ('\\x00')")


class LoraRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The LoRA adapter a request runs with (engine/lora.py): set by the gateway from the request's `model`.
    A sequence keeps its (id, version) for its whole life: an in-place reload gives later requests a new
    version, and the workers keep the old one while sequences still use it."""

    id: int  # vLLM's lora_int_id: 1, 2, ... in the order adapters were first loaded
    name: str
    path: str
    version: int  # 1 at the first load; +1 per in-place reload


class SamplingParams(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives per sampled token (0: only the sampled; -1: all)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many top alternatives (-1: all)
    # Beyond vLLM: per sampled token, the probability mass top-k/top-p/min-p (and a min_tokens ban) kept of
    # the penalised, temperature-scaled distribution; processed logprob = log_softmax(z / T) - log(mass).
    return_sampling_mass: bool = False
    trace_decode_token_ids: list[int] | None = None  # trace replay: forced output tokens (vLLM v0.33)
    # routed experts (--enable-return-routed-experts) are returned from this prompt position on (vLLM);
    # the gateway's business: the engine reports every position
    routed_experts_prompt_start: int = 0
    # vLLM's request-level cache_salt: prefix-cache blocks are shared only between requests with the same
    # salt (it enters the hash of the first block, so every later block inherits it); None: unsalted.
    cache_salt: str | None = None
    # guaranteed-valid output (vLLM's structured_outputs): the workers mask the logits per step
    structured_outputs: StructuredOutputsParams | None = None
    lora: LoraRef | None = None  # the adapter (--enable-lora); None: the base model
    # vLLM's logits processors of a request (workers/logits_processors.py applies them, docs/logprobs.md says
    # which logprobs see them): a bias added to the logits of these token ids (the gateway clamps it to [-100, 100]
    # as vLLM does), the only token ids that may be drawn, and the token sequences that may not be completed
    # (the gateway tokenizes `bad_words` into them, as vLLM's update_from_tokenizer)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's request-level priority (here with the sampling parameters, as cache_salt): with
    # --scheduling-policy priority lower values are admitted first and preempted last (engine/scheduler/policy.py)
    priority: int = 0

    def validate(self, *, vocab_size: int, max_logprobs: int, max_n: int = 128) -> None:
        _check(1 <= self.n <= max_n, "n", f"n must be between 1 and {max_n}, got {self.n}")
        # vLLM v0.33: finite (JSON's 1e999 parses to inf) and within [0, 2]
        _check(math.isfinite(self.temperature), "temperature",
               f"temperature must be a finite number, got {self.temperature}")
        _check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(self.temperature <= 2, "temperature", f"temperature must be in [0, 2], got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        _check(math.isfinite(self.repetition_penalty), "repetition_penalty",
               f"repetition_penalty must be a finite number, got {self.repetition_penalty}")
        _check(self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0")
        # vLLM: -1 asks for the whole vocabulary; --max-logprobs -1 allows it.
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(self, name)
            if value is None:
                continue
            _check(value >= -1, name, f"`{name}` must be a positive value or -1.")
            wanted = vocab_size if value == -1 else value
            _check(wanted <= cap, name,
                   f"Requested {what} logprobs of {wanted}, which is greater than max allowed: {cap}")
        for t in self.stop_token_ids:
            _check(0 <= t < vocab_size, "stop_token_ids",
                   f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**63, "seed", "seed must fit in 64 bits")
        _check(-(2**63) <= self.priority < 2**63, "priority", "priority must fit in 64 bits")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        self._validate_logits_processors(vocab_size)

    def _validate_logits_processors(self, vocab_size: int) -> None:
        """vLLM's checks of logit_bias, allowed_token_ids and bad_words (input_processor and SamplingParams)."""
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            _check(not bad, "logit_bias", f"token_id(s) {bad[:8]} in logit_bias contain out-of-vocab token ids. "
                                          f"Vocabulary size: {vocab_size}")
            off = [b for b in self.logit_bias.values() if not -100.0 <= b <= 100.0]  # NaN too
            _check(not off, "logit_bias", f"logit_bias values must be within [-100, 100], got {off[:1]}")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "allowed_token_ids is not None and empty!")
            _check(all(0 <= t < vocab_size for t in self.allowed_token_ids), "allowed_token_ids",
                   f"allowed_token_ids contains out-of-vocab token id! Vocabulary size: {vocab_size}")
        _check(all(self.bad_words), "bad_words", f"bad_words cannot contain an empty string. Got "
                                                 f"bad_words={self.bad_words}")
        for word in self.bad_words_token_ids or []:
            _check(len(word) > 0, "bad_words", "bad_words entries must tokenize to at least one token.")
            bad = [t for t in word if not 0 <= t < vocab_size]
            _check(not bad, "bad_words", f"The model vocabulary size is {vocab_size}, but the following tokens "
                                         f"were specified as bad: {bad[:8]}. All token id values should be "
                                         f"integers satisfying: 0 <= token_id < {vocab_size}.")

    @property
    def processes_logits(self) -> bool:
        """A logit bias, an allowed-ids list or bad words: the sampler edits this row's logits."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    def validate_priority(self, policy: str) -> None:
        """vLLM: a priority other than 0 needs --scheduling-policy priority."""
        _check(self.priority == 0 or policy == "priority", "priority",
               f"Got priority {self.priority} but Priority scheduling is not enabled: start the server with "
               "--scheduling-policy priority.")

    def validate_routed_experts(self, prompt_len: int) -> None:
        """vLLM: routed_experts_prompt_start must lie within [0, prompt_len]."""
        v = self.routed_experts_prompt_start
        _check(0 <= v <= prompt_len, "routed_experts_prompt_start",
               f"routed_experts_prompt_start must be within [0, {prompt_len}] (the prompt's length in tokens), "
               f"got {v}")

    def validate_trace(self, *, vocab_size: int, enabled: bool) -> None:
        """vLLM's trace-replay checks (sampling_params._validate_trace_replay), after `validate`."""
        trace = self.trace_decode_token_ids
        if trace is None:
            return
        p = "trace_decode_token_ids"
        _check(enabled, p, "trace_decode_token_ids is set but trace replay is not enabled: start the server "
                           "with --enable-trace-replay")
        _check(len(trace) > 0, p, "trace_decode_token_ids must be a non-empty list.")
        _check(self.n == 1, p, "trace_decode_token_ids requires n=1.")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in trace), p,
               "trace_decode_token_ids must contain non-negative integers.")
        _check(self.prompt_logprobs is None, p, "trace_decode_token_ids is not supported with prompt_logprobs.")
        _check(not self.bad_words and not self.bad_words_token_ids, p,
               "trace_decode_token_ids is not supported with bad_words.")
        bad = [t for t in trace if t >= vocab_size]
        _check(not bad, p, f"token_id(s) {bad[:8]} in trace_decode_token_ids contain out-of-vocab token ids. "
                           f"Vocabulary size: {vocab_size}")

    def for_trace_replay(self, prompt_len: int, max_model_len: int) -> "SamplingParams":
        """vLLM's _normalize_trace_replay_params: the trace is cut to fit the context, max_tokens becomes
        min(len(trace), max_tokens), and nothing may stop the replay early (no EOS, stop ids or strings)."""
        trace = list(self.trace_decode_token_ids or [])[:max(max_model_len - prompt_len, 1)]
        limit = len(trace) if self.max_tokens is None else min(len(trace), self.max_tokens)
        return self.replace(trace_decode_token_ids=trace, max_tokens=limit, min_tokens=0,
                                   ignore_eos=True, stop=[], stop_token_ids=[])

    def num_logprobs(self, vocab_size: int) -> int:
        """Top alternatives the worker computes per sampled token (-1: the whole vocabulary)."""
        return vocab_size if self.logprobs == -1 else (self.logprobs or 0)

    def num_prompt_logprobs(self, vocab_size: int) -> int:
        return vocab_size if self.prompt_logprobs == -1 else (self.prompt_logprobs or 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def validate_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A prompt the model can read: not empty, every id inside the vocabulary (vLLM's messages). The gateway
    checks every prompt with it, and the scheduler every AddRequest that arrives on the bus."""
    _check(len(ids) > 0, param, "The decoder prompt cannot be empty")
    lo, hi = min(ids), max(ids)
    _check(lo >= 0 and hi < vocab_size, param, f"Token id {lo if lo < 0 else hi} is out of vocabulary")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


def tokenize_bad_words(words: list[str], encode) -> list[list[int]]:
    """vLLM's update_from_tokenizer: each bad word's token ids as written (leading spaces stripped), and again
    with one leading space when that gives a different first token and as many tokens (a word in the middle
    of text); `encode(text)` is the tokenizer without special tokens. ParamError naming bad_words when a word
    tokenizes to nothing."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        bare = list(encode(word.lstrip()))
        _check(len(bare) > 0, "bad_words", "bad_words entries must tokenize to at least one token.")
        out.append(bare)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
