"""The request fields that ask for guaranteed-valid output, turned into one StructuredOutputsParams.

As vLLM 0.33: `structured_outputs` {json, regex, choice, grammar, json_object, disable_any_whitespace,
disable_additional_properties, whitespace_pattern}; `response_format` {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, which overrides the matching field of
structured_outputs; exactly one constraint in the end. Beyond vLLM 0.33 (which dropped them and ignores
them), the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_json_object` and
`guided_whitespace_pattern` are accepted as aliases of the structured_outputs fields. Every error is a
ParamError naming the field the client set; the constraint is compiled here once (cached) so a regex or
grammar that does not compile is a 400, never a failed step.
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


def forced_tool_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The constraint of a forced tool choice (engine.structured_outputs.tool_choice_schema's schema);
    a tool schema the grammar engine cannot handle is a ParamError naming `tools`."""
    so = StructuredOutputsParams(json=json.dumps(schema))
    try:
        check_compiles(so)
    except ParamError as e:
        raise ParamError("tools", f"the tools' parameters cannot be enforced: {e}") from None
    return so


