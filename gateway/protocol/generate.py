"""POST /inference/v1/generate (tokens in, tokens out): the request body, as vLLM accepts it; its
sampling_params are gateway/protocol/sampling.py's GenerateSamplingParams."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from bus.sampling_params import ParamError
from gateway.protocol.fields import _EMPTY_ARRAY, _EMPTY_OBJECT, _I64, _TOKEN_IDS, OpenAIModel, StreamOptions, _schema
from gateway.protocol.refused import REFUSED_GENERATE, refuse_unsupported
from gateway.protocol.sampling import _STREAM_RULES, GenerateSamplingParams


class GenerateRequest(OpenAIModel):
    """POST /inference/v1/generate in tokens mode (vLLM v0.33 `GenerateRequest`)."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {
        "stream_options": _STREAM_RULES["stream_options"],
        "stream": {"anyOf": [
            {"properties": {"stream": {"enum": [None, False]}}},
            {"properties": {"sampling_params": {"properties": {"prompt_logprobs": {"type": "null"}}}}}]},
    }})

    request_id: str | None = None
    token_ids: list[int] = Field(json_schema_extra={"minItems": 1, **_TOKEN_IDS})
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: str = _schema("tokens", enum=["tokens"])  # vLLM's text/derender modes are not offered here
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # see docs/openai-api.md
    priority: int = Field(default=0, **_I64)  # --scheduling-policy priority: lower first
    # what POST /v1/chat/completions/render puts in its output, read only by modes refused here
    token_offsets: list[tuple[int, int]] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    parse_context: dict[str, Any] | None = None
    # vLLM fields rollbus refuses unless they ask for nothing (REFUSED_GENERATE)
    features: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    content_parts: list[dict[str, Any]] | None = _schema(**_EMPTY_ARRAY)
    kv_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)
    ec_transfer_params: dict[str, Any] | None = _schema(**_EMPTY_OBJECT)

    def check(self) -> None:
        refuse_unsupported(self, REFUSED_GENERATE)
        if self.output_mode != "tokens":
            raise ParamError("output_mode", f"`output_mode` {self.output_mode!r} is not supported by rollbus: only "
                                            "\"tokens\" is; decode the token ids on the client (POST /detokenize).")
        if not self.token_ids:
            raise ParamError("token_ids", "token_ids must contain at least one token")
        if any(t < 0 for t in self.token_ids):
            raise ParamError("token_ids", "token_ids must not contain negative values")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        p = self.sampling_params.prompt_logprobs
        if p is not None and p < -1:
            raise ParamError("sampling_params.prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.include_usage() and self.stream_options and self.stream_options.continuous_usage_stats)
