"""Constraints for guaranteed-valid output: pure policy, no sockets, no devices.

A request's constraint is one `StructuredOutputsParams` (bus/sampling_params.py). This module turns it
into the grammar the engine enforces (llguidance's serialized form, the same text for every process, so it
is also the cache key of compiled grammars), checks that it compiles (a 400 naming the field when not),
and builds vLLM's JSON schema for a forced tool choice (`tool_choice: "required"` or a named function).

The grammar engine is llguidance (one of vLLM's two backends; its matcher runs in the workers, see
workers/grammar.py). What is accepted:
  json         a JSON Schema (checked against its meta-schema, then compiled by llguidance)
  json_object  any JSON object
  regex        Rust `regex` syntax, anchored at both ends
  choice       one of the strings, exactly
  grammar      a Lark grammar, or GBNF (llama.cpp's EBNF, vLLM's xgrammar format), converted to Lark
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from bus.sampling_params import ParamError, StructuredOutputsParams
from engine.argv import json_object_flag

_CACHE = 1024  # distinct constraints remembered (grammar text, compile verdicts)


def constraint_kind(so: StructuredOutputsParams) -> str:
    """Which constraint field is set ("json", "regex", ...)."""
    for f in ("json", "json_object", "regex", "choice", "grammar"):
        if getattr(so, f) is not None:
            return f
    raise ParamError("structured_outputs", "You must use one kind of structured outputs constraint but none are "
                                           "specified")


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of the constraint (raises ParamError naming the constraint's field)."""
    return _grammar_text(msgspec.msgpack.encode(so))


@lru_cache(maxsize=_CACHE)
def _grammar_text(key: bytes) -> str:
    import llguidance

    so = msgspec.msgpack.decode(key, type=StructuredOutputsParams)
    kind = constraint_kind(so)
    param = f"structured_outputs.{kind}"
    options: dict[str, Any] = {"whitespace_flexible": not so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    try:
        if kind == "json":
            schema = _parse_schema(so.json or "", param)
            if so.disable_additional_properties:
                schema = _closed_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "regex":
            return llguidance.grammar_from("regex", so.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(so.choice))
        return llguidance.grammar_from("grammar", so.grammar)
    except ParamError:
        raise
    except RecursionError:
        raise ParamError(param, f"{param} is nested too deeply") from None
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # llguidance's compile errors
        raise ParamError(param, f"Invalid {param}: {e}") from None


def check_compiles(so: StructuredOutputsParams, tokenizer: Any = None) -> None:
    """ParamError unless the constraint compiles (with the model's tokenizer, an llguidance LLTokenizer,
    when given: special tokens in a Lark grammar need it). Verdicts are cached by constraint."""
    text = grammar_text(so)
    error = _verdict(text, tokenizer)
    if error:
        kind = constraint_kind(so)
        raise ParamError(f"structured_outputs.{kind}", f"Grammar error in structured_outputs.{kind}: {error}")


@lru_cache(maxsize=_CACHE)
def _verdict(text: str, tokenizer: Any) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(text, tokenizer)


def _parse_schema(text: str, param: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ParamError(param, f"{param} is not valid JSON: {e}") from None
    check_json_schema(schema, param)
    return schema


def check_json_schema(schema: Any, param: str) -> None:
    """ParamError unless `schema` is a JSON Schema (a boolean or an object valid against its meta-schema:
    the draft its `$schema` names, else 2020-12)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ParamError(param, f"{param} must be a JSON Schema object, got {type(schema).__name__}")
    import jsonschema

    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):  # jsonschema itself would raise a TypeError
        raise ParamError(param, f"{param} is not a valid JSON Schema: `$schema` must be a string")
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ParamError(param, f"{param} is not a valid JSON Schema: {e.message}"
                                + (f" (at {where})" if where else "")) from None
    except RecursionError:
        raise ParamError(param, f"{param} is nested too deeply") from None
    except (TypeError, ValueError, AttributeError) as e:  # a schema jsonschema cannot read
        raise ParamError(param, f"{param} is not a valid JSON Schema: {e}") from None


def _closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without additionalProperties gets false."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    # an object whose keys come from sub-schemas (anyOf, allOf, $ref...) is closed there, not here
    combined = any(k in out for k in ("anyOf", "oneOf", "allOf", "$ref", "if"))
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out and not combined:
        out["additionalProperties"] = False
    return out


# --- forced tool choice ---------------------------------------------------------------------------------


def _params_schema(params: dict[str, Any] | None) -> dict[str, Any]:
    """Missing or empty parameters still constrain the arguments to a JSON object (vLLM)."""
    return params if params else {"type": "object", "properties": {}}


def tool_choice_schema(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                       parallel_tool_calls: bool | None) -> dict[str, Any] | None:
    """vLLM's schema for a forced tool choice (`tools` as OpenAI sends them: {"type", "function": {...}}):
    a named function constrains the output to its arguments object; "required" to a non-empty JSON array of
    {"name", "parameters"} (one item at most when parallel_tool_calls is false), the tools' `$defs` merged at
    the top. None for any other choice. Raises ParamError for an undefined name or clashing `$defs`."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        for fn in functions:
            if fn.get("name") == name:
                return _params_schema(fn.get("parameters"))
        raise ParamError("tool_choice", f"Tool '{name}' has not been passed in `tools`.")
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for fn in functions:
        params = dict(fn.get("parameters") or {})
        fn_defs = params.pop("$defs", {})
        if not isinstance(fn_defs, dict):
            raise ParamError("tools", f"`$defs` in the parameters of tool '{fn.get('name')}' must be an object, "
                                      f"got {type(fn_defs).__name__}.")
        for k, v in fn_defs.items():
            if k in defs and defs[k] != v:
                raise ParamError("tools", f"Tool definition '{k}' has multiple schemas, which is not supported.")
            defs[k] = v
        # additionalProperties false: what vLLM's default backend (xgrammar, strict) enforces on this schema;
        # llguidance reads an absent one as true, and a weak model then wanders into keys of its own
        variants.append({"properties": {"name": {"type": "string", "enum": [fn.get("name")]},
                                        "parameters": _params_schema(params)},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# --- --structured-outputs-config (vLLM's StructuredOutputsConfig) -------------------------------------

SO_BACKENDS = ("auto", "guidance")  # llguidance is vLLM's "guidance" backend; "auto" picks it here


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False  # no whitespace between JSON tokens (weak models ramble whitespace)
    disable_additional_properties: bool = False  # objects without additionalProperties get false

    def apply(self, so: StructuredOutputsParams) -> StructuredOutputsParams:
        """The server-wide options on one request's constraint (the workers compile with them)."""
        if not (self.disable_any_whitespace or self.disable_additional_properties):
            return so
        return msgspec.structs.replace(
            so, disable_any_whitespace=so.disable_any_whitespace or self.disable_any_whitespace,
            disable_additional_properties=so.disable_additional_properties or self.disable_additional_properties)


def parse_structured_outputs_config(text: str | None) -> StructuredOutputsConfig:
    """--structured-outputs-config (a JSON object); ValueError, a start-up error, for anything invalid."""
    flag = "--structured-outputs-config"
    known = {"backend", "disable_any_whitespace", "disable_additional_properties", "disable_fallback",
             "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning"}
    raw = json_object_flag(flag, text, known, '{"disable_any_whitespace": true}')
    if raw is None:
        return StructuredOutputsConfig()
    backend = raw.get("backend", "auto")
    if backend not in SO_BACKENDS:
        raise ValueError(f"{flag}: backend {backend!r} is not available; rollbus's grammar engine is llguidance: "
                         f"{' or '.join(SO_BACKENDS)}")
    for key in ("reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning"):
        if raw.get(key) not in (None, "", False):
            raise ValueError(f"{flag}: {key} is not supported by rollbus's structured outputs")
    flags = {}
    for key in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        v = raw.get(key, False)
        if not isinstance(v, bool):
            raise ValueError(f"{flag}: {key} must be true or false, got {v!r}")
        flags[key] = v
    flags.pop("disable_fallback")  # one backend: there is nothing to fall back to
    return StructuredOutputsConfig(backend, **flags)
