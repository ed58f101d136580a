"""The request fields that ask for guaranteed-valid output, turned into one StructuredOutputsParams.

As vLLM 0.33: `structured_outputs` {json, regex, choice, grammar, json_object, disable_any_whitespace,
disable_additional_properties, whitespace_pattern}; `response_format` {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, which overrides the matching field of
structured_outputs; exactly one constraint in the end. Beyond vLLM 0.33 (which dropped them and ignores
them), the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_json_object` and
`guided_whitespace_pattern` are accepted as aliases of the structured_outputs fields. Every error is a
ParamError naming the field the client set; the constraint is compiled here once (cached) so a regex or
grammar that does not compile is a 400, never a failed step.

A `response_format` json_schema and a forced tool choice promise a parseable object, and a small model at
temperature 1 spends max_tokens on whatever the grammar leaves open, so for those two:
  - `disable_any_whitespace` is on by default (beyond vLLM, whose default allows any whitespace between
    JSON tokens); `structured_outputs.disable_any_whitespace: false` or a `whitespace_pattern` in the
    request gives back the flexible whitespace;
  - `disable_additional_properties` is on by default: an object schema without `additionalProperties`
    allows no other keys, which is what vLLM's default backend (xgrammar, strict mode) enforces and what
    OpenAI's strict schemas say (llguidance alone reads an absent one as true);
    `structured_outputs.disable_additional_properties: false` allows them again.
"""

from __future__ import annotations

import json
from typing import Any

from bus.sampling_params import CONSTRAINT_FIELDS, ParamError, StructuredOutputsParams
from engine.structured_outputs import check_compiles, constraint_kind

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_json_object": "json_object",
                  "guided_whitespace_pattern": "whitespace_pattern"}
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# vLLM fields of StructuredOutputsParams that select or tune a backend: nothing to select here
_BACKEND_FIELDS = ("disable_fallback", "_backend", "_backend_was_auto")
BACKENDS = (None, "auto", "guidance", "llguidance")


def _typed(field: str, value: Any, param: str) -> Any:
    """The value of one structured_outputs field, type-checked; json becomes its JSON text."""
    if field == "json":
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, bool)):
            return json.dumps(value)
        raise ParamError(param, f"`{param}` must be a JSON Schema (an object, or its JSON text)")
    if field == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ParamError(param, f"`{param}` must be a list of strings")
        return value
    if field in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(value, bool):
            raise ParamError(param, f"`{param}` must be a boolean")
        return value
    if not isinstance(value, str):
        raise ParamError(param, f"`{param}` must be a string")
    return value


def build_constraint(structured_outputs: dict[str, Any] | None, response_format: dict[str, Any] | None,
                     guided: dict[str, Any], prefix: str = "") -> StructuredOutputsParams | None:
    """The request's one constraint (None when it asks for none); raises ParamError naming the field."""
    fields: dict[str, Any] = {}
    source: dict[str, str] = {}  # constraint field -> the request field it came from

    def put(field: str, value: Any, param: str) -> None:
        fields[field] = _typed(field, value, param)
        source[field] = param

    for key, value in (structured_outputs or {}).items():
        param = f"{prefix}structured_outputs.{key}"
        if value is None:
            continue
        if key == "structural_tag":
            raise ParamError(param, f"`{param}` is not supported by rollbus: structural tags are not implemented "
                                    "(use json, regex, choice or grammar).")
        if key in CONSTRAINT_FIELDS or key in _OPTIONS:
            put(key, value, param)
        elif key not in _BACKEND_FIELDS:
            raise ParamError(param, f"`{param}` is not a field of structured_outputs (vLLM's StructuredOutputsParams)")
    for alias, field in GUIDED_ALIASES.items():
        if guided.get(alias) is not None:
            if field in fields:
                raise ParamError(alias, f"`{alias}` and `{source[field]}` both set the {field} constraint")
            put(field, guided[alias], alias)
    backend = guided.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise ParamError("guided_decoding_backend", f"`guided_decoding_backend` {backend!r} is not available: "
                                                    "rollbus's structured outputs engine is llguidance (guidance)")
    rf = response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            fields["json_object"], source["json_object"] = True, f"{prefix}response_format"
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise ParamError("response_format", "When response_format type is 'json_schema', the 'json_schema' "
                                                    "field must be provided.")
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:  # OpenAI: a json_schema without `schema` allows any JSON value
                schema = {}
            put("json", schema, "response_format.json_schema.schema")
        elif kind == "structural_tag":
            raise ParamError("response_format", "`response_format` structural_tag is not supported by rollbus: "
                                                "structural tags are not implemented.")
        elif kind not in (None, "text"):
            raise ParamError("response_format", f"`response_format` type {kind!r} is not one of 'text', "
                                                "'json_object', 'json_schema'")
    if not any(f in fields for f in CONSTRAINT_FIELDS):
        return None
    if source.get("json") == "response_format.json_schema.schema":
        _compact_by_default(fields)
    so = StructuredOutputsParams(**fields)
    try:
        so.validate()
        check_compiles(so)
    except ParamError as e:
        given = [f for f in CONSTRAINT_FIELDS if f in fields]
        if len(given) > 1:
            listed = ", ".join(source[f] for f in given)
            raise ParamError(source[given[1]], "You can only use one kind of structured outputs constraint but "
                                               f"multiple are specified: {listed}") from None
        raise ParamError(source.get(constraint_kind(so), e.param), str(e)) from None
    return so


def _compact_by_default(fields: dict[str, Any]) -> None:
    """No free whitespace between JSON tokens unless the request chose its whitespace itself, and no keys
    an object schema does not name unless the request allows them."""
    if "disable_any_whitespace" not in fields and fields.get("whitespace_pattern") is None:
        fields["disable_any_whitespace"] = True
    fields.setdefault("disable_additional_properties", True)


def forced_tool_constraint(schema: dict[str, Any], structured_outputs: dict[str, Any] | None = None,
                           guided: dict[str, Any] | None = None) -> StructuredOutputsParams:
    """The constraint of a forced tool choice (engine.structured_outputs.tool_choice_schema's schema), with the
    whitespace options of the request's structured_outputs (or guided_whitespace_pattern); a tool schema the
    grammar engine cannot handle is a ParamError naming `tools`."""
    options: dict[str, Any] = {}
    for key in _OPTIONS:
        value = (structured_outputs or {}).get(key)
        if value is not None:
            options[key] = _typed(key, value, f"structured_outputs.{key}")
    if (guided or {}).get("guided_whitespace_pattern") is not None and "whitespace_pattern" not in options:
        options["whitespace_pattern"] = _typed("whitespace_pattern", guided["guided_whitespace_pattern"],
                                               "guided_whitespace_pattern")
    _compact_by_default(options)
    so = StructuredOutputsParams(json=json.dumps(schema), **options)
    try:
        check_compiles(so)
    except ParamError as e:
        raise ParamError("tools", f"the tools' parameters cannot be enforced: {e}") from None
    return so
