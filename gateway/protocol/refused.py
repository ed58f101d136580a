"""The fields of vLLM's request schemas that rollbus does not implement: each is refused (a 400 naming it) when
its value asks for something, and accepted when it asks for nothing (the default, null, an empty list).
docs/openai-api.md lists them, tested against these tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel

from bus.sampling_params import ParamError


class Refuse(NamedTuple):
    """A vLLM field rollbus does not implement: `neutral(value)` says the value asks for nothing."""

    neutral: Callable[[Any], bool]
    why: str


def _unset(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v == default


def _trace_only(v: Any) -> bool:
    """vllm_xargs asks for nothing rollbus lacks when it holds at most trace_decode_token_ids."""
    return _unset(v) or (isinstance(v, dict) and set(v) <= {"trace_decode_token_ids"})


_MULTIMODAL = "rollbus serves text-only models"
_DISAGG = "disaggregated serving (KV/EC transfer) is not supported"

# Shared by /v1/completions and /v1/chat/completions (vLLM v0.33 field names).
REFUSED_SAMPLING: dict[str, Refuse] = {
    "use_beam_search": Refuse(_unset, "beam search is not supported"),
    "length_penalty": Refuse(_equals(1.0), "it only applies to beam search, which is not supported"),
    "watermarking": Refuse(_unset, "watermarking is not supported"),
    "logprob_token_ids": Refuse(_unset, "logprobs of chosen token ids are not supported; use logprobs"),
    "thinking_token_budget": Refuse(_unset, "thinking token budgets are not supported"),
    "repetition_detection": Refuse(_unset, "repetition detection is not supported"),
    "kv_transfer_params": Refuse(_unset, _DISAGG),
    "ec_transfer_params": Refuse(_unset, _DISAGG),
    "vllm_xargs": Refuse(_trace_only, "custom sampling extensions are not supported; the one key served is "
                                      "trace_decode_token_ids (trace replay, with --enable-trace-replay)"),
    "best_of": Refuse(_equals(1), "removed from vLLM; use n"),
}
REFUSED_COMPLETION: dict[str, Refuse] = {
    **REFUSED_SAMPLING,
    "suffix": Refuse(_unset, "suffix is not currently supported"),
    "prompt_embeds": Refuse(_unset, "prompt embeddings are not supported"),
}
REFUSED_CHAT: dict[str, Refuse] = {
    **REFUSED_SAMPLING,
    "echo": Refuse(_unset, "echoing the last message into the response is not supported yet"),
    "return_prompt_text": Refuse(_unset, "returning the rendered prompt is not supported yet; "
                                         "use POST /v1/chat/completions/render"),
    "media_io_kwargs": Refuse(_unset, _MULTIMODAL),
    "mm_processor_kwargs": Refuse(_unset, _MULTIMODAL),
}
# POST /inference/v1/generate: the request and its sampling_params (vLLM's SamplingParams).
REFUSED_GENERATE: dict[str, Refuse] = {
    "features": Refuse(_unset, _MULTIMODAL),
    "content_parts": Refuse(_unset, _MULTIMODAL),
    "kv_transfer_params": Refuse(_unset, _DISAGG),
    "ec_transfer_params": Refuse(_unset, _DISAGG),
}
REFUSED_ENGINE_SAMPLING: dict[str, Refuse] = {
    "watermarking": Refuse(_unset, "watermarking is not supported"),
    "prompt_logprob_token_ids": Refuse(_unset, "prompt logprobs of chosen token ids are not supported"),
    "prompt_logprob_start": Refuse(_unset, "prompt logprobs from a start position are not supported"),
    "logprob_token_ids": Refuse(_unset, "logprobs of chosen token ids are not supported; use logprobs"),
    "extra_args": Refuse(_unset, "custom sampling extensions are not supported"),
    "skip_reading_prefix_cache": Refuse(_unset, "every request may read the prefix cache here"),
    "thinking_token_budget": Refuse(_unset, "thinking token budgets are not supported"),
    "repetition_detection": Refuse(_unset, "repetition detection is not supported"),
}


def refuse_unsupported(model: BaseModel, table: dict[str, Refuse], prefix: str = "") -> None:
    """400 (ParamError naming the field) for a field the request set to something rollbus cannot do."""
    for name in model.model_fields_set:
        rule = table.get(name)
        if rule is not None and not rule.neutral(getattr(model, name)):
            raise ParamError(prefix + name, f"`{prefix}{name}` is not supported by rollbus: {rule.why}.")
