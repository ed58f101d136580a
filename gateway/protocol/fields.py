"""What every request body of gateway.protocol shares: the base model (unknown fields ignored with a log line,
as vLLM does), stream_options, and the JSON-schema keywords the published schema (/openapi.json) states for
fields whose checks live elsewhere."""

from __future__ import annotations

from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = structlog.get_logger()

_I64: dict[str, int] = {"ge": -(2**63), "le": 2**63 - 1}


def _schema(default: Any = None, **schema: Any) -> Any:
    """A field whose published JSON schema (/openapi.json) states the values vLLM's checks accept, so a
    schema-driven client or fuzzer knows them; the checks themselves stay where they are (SamplingParams,
    the `check` methods, the Refuse tables), with vLLM's messages. Numeric, string and array keywords apply
    only to values of their type, so they sit beside an `anyOf` with null."""
    return Field(default, json_schema_extra=schema)


_NEUTRAL_BOOL = {"enum": [None, False]}  # a refused feature's switch: only "off" is served
_EMPTY_OBJECT = {"maxProperties": 0}
_EMPTY_ARRAY = {"maxItems": 0}
_TOKEN_IDS = {"items": {"minimum": 0}}  # the gateway's /openapi.json adds the vocabulary's maximum
_LOGIT_BIAS = {"propertyNames": {"pattern": "^[0-9]{1,9}$"}}  # token id -> bias (clamped to [-100, 100])
_BAD_WORDS = {"items": {"minLength": 1, "pattern": "[^ ]"}}  # a word of only spaces tokenizes to nothing


class OpenAIModel(BaseModel):
    """Base: ignore unknown fields like vLLM, but say which ones were ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                log.info("gateway.ignored_fields", model=cls.__name__, fields=sorted(unknown)[:20])
        return data


class StreamOptions(OpenAIModel):
    # its name in the published schema (/openapi.json: gateway__protocol__StreamOptions, beside the Responses
    # API's own) is that of the package that exports it
    __module__ = "gateway.protocol"

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False

