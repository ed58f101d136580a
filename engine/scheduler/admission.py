"""Admission of a request that arrives on the bus: the scheduler checks every AddRequest with this pure
function before it queues it, so nothing a worker cannot run reaches a step (a token id outside the
vocabulary in one request would fail the whole batch it rides in).

The gateway already refuses all of this with a 400; these checks are for whatever else speaks the bus (a
trainer, a script, a bug). The rules are the gateway's own: `SamplingParams.validate` and its trace and
routed-experts checks, `validate_prompt_ids`, that a structured-output constraint compiles
(engine.structured_outputs, without the tokenizer, which the scheduler does not load), and the
context-length rule, with the engine's real limits (the vocabulary and max_model_len the workers
reported). A refused request is answered with an `ErrorInfo` (status 400, `param` the AddRequest
field: `prompt_token_ids`, `eos_token_ids` or `sampling.<name>`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.messages import AddRequest, ErrorInfo, ErrorKind
from bus.sampling_params import ParamError, validate_prompt_ids
from engine.structured_outputs import check_compiles


@dataclass(frozen=True, slots=True)
class EngineLimits:
    vocab_size: int  # the model's (the smallest any worker reported)
    max_model_len: int
    max_logprobs: int = 20  # --max-logprobs (-1: the whole vocabulary)
    enable_trace_replay: bool = False  # --enable-trace-replay
    scheduling_policy: str = "fcfs"  # --scheduling-policy


def admission_error(req: AddRequest, limits: EngineLimits) -> ErrorInfo | None:
    """None when the request may be queued; else why not, naming the field."""
    n = len(req.prompt_token_ids)
    if n >= limits.max_model_len:
        return ErrorInfo(ErrorKind.PROMPT_TOO_LONG,
                         f"prompt of {n} tokens does not fit max_model_len {limits.max_model_len}",
                         status=400, param="prompt_token_ids")
    try:
        validate_prompt_ids(req.prompt_token_ids, limits.vocab_size, "prompt_token_ids")
        bad = [t for t in req.eos_token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ParamError("eos_token_ids", f"eos token id {bad[0]} is outside the vocabulary "
                                              f"[0, {limits.vocab_size})")
        sp = req.sampling
        try:
            sp.validate(vocab_size=limits.vocab_size, max_logprobs=limits.max_logprobs)
            sp.validate_routed_experts(n)
            sp.validate_priority(limits.scheduling_policy)
            sp.validate_trace(vocab_size=limits.vocab_size, enabled=limits.enable_trace_replay)
            if sp.structured_outputs is not None:  # the shape was checked by validate; now that it compiles
                check_compiles(sp.structured_outputs)
            if sp.max_tokens is not None and n + sp.max_tokens > limits.max_model_len:
                raise ParamError("max_tokens", f"max_tokens {sp.max_tokens} with a prompt of {n} tokens exceeds "
                                               f"max_model_len {limits.max_model_len}")
        except ParamError as e:
            raise ParamError(f"sampling.{e.param}", str(e)) from None
    except ParamError as e:
        return ErrorInfo(type(e).__name__, str(e), status=400, param=e.param)
    return None
