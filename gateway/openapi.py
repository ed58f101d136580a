"""/openapi.json with the request bodies in it. The routes read their bodies themselves (vLLM's error
messages, ignored-field logging, one parse), so FastAPI does not know them; this adds each route's body
schema (the pydantic models of gateway/protocol/ and vllm_routes.py, and the JSON objects the RL routes
take), the values each query parameter accepts, and the limits of this server: the vocabulary for token ids,
max_model_len for max_tokens and prompt lengths, --max-logprobs. A client or a fuzzer (tests/test_fuzz_http.py)
that follows the schema sends requests the server can serve; what the schema cannot say (min_tokens <=
max_tokens, a prompt and max_tokens within the context) the checks in the handlers still refuse with a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from bus.control_state import SLEEP_TAGS
from engine.weights.lifecycle import PAUSE_MODES
from gateway.errors import MAX_TIMEOUT_S, MIN_TIMEOUT_S

REF = "#/components/schemas/{model}"
_BOOL_STRINGS = {"type": "string", "enum": ["true", "false", "1", "0", "yes", "no", "on", "off"]}
_TIMEOUT = {"type": "number", "minimum": MIN_TIMEOUT_S, "maximum": MAX_TIMEOUT_S}
_NON_EMPTY = {"type": "string", "minLength": 1}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


# JSON bodies of the RL routes (gateway/dev_routes.py, gateway/weight_routes.py), as their handlers read them
RL_BODIES: dict[str, dict[str, Any]] = {
    "/collective_rpc": {"anyOf": [
        _obj({"method": {"type": "string", "enum": ["reload_weights"]}, "args": {"type": "array", "maxItems": 0},
              "kwargs": _obj({"weights_path": {"type": "string"}}) | {"additionalProperties": False},
              "timeout": _TIMEOUT}, ("method",)),
        # SkyRL's sync methods, answered natively (gateway/dev_routes.py sync_sleep_rpc)
        _obj({"method": {"type": "string", "enum": ["skyrl_sleep_for_weight_sync"]},
              "kwargs": _obj({"offload_kv": {"type": "boolean"}}) | {"additionalProperties": False},
              "timeout": _TIMEOUT}, ("method",)),
        _obj({"method": {"type": "string", "enum": ["skyrl_wake_for_weight_sync"]},
              "kwargs": _obj({"tags": {"type": "array", "items": {"type": "string", "enum": ["weights", "kv_cache"]}}})
              | {"additionalProperties": False}, "timeout": _TIMEOUT}, ("method",)),
        # SkyRL's in-memory LoRA calls, with --enable-lora (gateway/lora_routes.py)
        _obj({"method": {"type": "string", "enum": ["skyrl_set_lora_receive_target"]},
              "kwargs": _obj({"receive_target": _obj({
                  "kind": {"type": "string", "enum": ["lora"]}, "lora_name": _NON_EMPTY, "adapter_config": _obj(
                      {"r": {"type": "integer", "minimum": 1}, "lora_alpha": {"type": "number"}}, ("r",)),
                  "aliases": {"type": "object", "additionalProperties": {"type": "string"}}},
                  ("kind", "lora_name", "adapter_config"))}, ("receive_target",)), "timeout": _TIMEOUT},
             ("method", "kwargs")),
        _obj({"method": {"type": "string", "enum": ["skyrl_discard_in_memory_lora"]},
              "kwargs": _obj({"lora_name": _NON_EMPTY}, ("lora_name",)), "timeout": _TIMEOUT}, ("method", "kwargs"))]},
    "/abort_requests": _obj({"request_ids": {"type": "array", "items": {"type": "string"}}}),
    # its options as query parameters or in this body (gateway/dev_routes.py); the body is optional
    "/reset_prefix_cache": _obj({"reset_running_requests": {"type": "boolean"}, "reset_external": {"type": "boolean"}})
    | {"additionalProperties": False},
    "/update_weight_version": _obj({"new_version": _NON_EMPTY}, ("new_version",)),
    "/init_weight_transfer_engine": _obj({"init_info": _obj({"timeout_s": _TIMEOUT})}, ("init_info",)),
    "/update_weights": _obj({"update_info": {"anyOf": [{"type": "object"},
                                                       {"type": "array", "items": {"type": "object"}}]}},
                            ("update_info",)),
    "/finish_weight_update": _obj({"weight_version": _NON_EMPTY, "commit": {"type": "boolean"}}),
    "/commit_weight_update": _obj({"weight_version": _NON_EMPTY,
                                   "fleet": {"type": "array", "items": {"type": "string"}}}),
    "/weight_checker": _obj({"action": {"type": "string", "enum": ["checksum", "compare", "reset"]},
                             "baseline": {"type": "object", "additionalProperties": {"type": "string"}}},
                            ("action",)),
    "/inference/v1/abort_requests": _obj({"request_ids": {"type": "array", "items": {"type": "string"}}},
                                         ("request_ids",)),
}
# the accepted values of query parameters the handlers check themselves: (path, name) -> schema
QUERY: dict[tuple[str, str], dict[str, Any]] = {
    ("/pause", "mode"): {"type": "string", "enum": list(PAUSE_MODES)},
    ("/pause", "clear_cache"): _BOOL_STRINGS,
    ("/pause", "timeout"): _TIMEOUT,
    ("/sleep", "level"): {"type": "string", "enum": ["0", "1", "2"]},
    ("/sleep", "mode"): {"type": "string", "enum": list(PAUSE_MODES)},
    ("/wake_up", "tags"): {"type": "array", "items": {"type": "string", "enum": list(SLEEP_TAGS)}},
    ("/reset_prefix_cache", "reset_running_requests"): _BOOL_STRINGS,
    ("/reset_prefix_cache", "reset_external"): _BOOL_STRINGS,
    ("/server_info", "config_format"): {"type": "string", "enum": ["text", "json"]},
    ("/get_world_size", "include_dp"): _BOOL_STRINGS,
}


def model_bodies() -> dict[str, Any]:
    """path -> the pydantic model(s) of its JSON body (a tuple: any one of them)."""
    from gateway.protocol.chat import ChatCompletionRequest
    from gateway.protocol.completions import CompletionRequest
    from gateway.protocol.generate import GenerateRequest
    from gateway.responses_protocol import ResponsesRequest
    from gateway.skyrl_routes import SkyrlGenerateRequest
    from gateway.vllm_routes import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

    return {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions/render": CompletionRequest, "/v1/chat/completions/render": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest, "/inference/v1/generate": GenerateRequest,
            "/skyrl/v1/generate": SkyrlGenerateRequest,
            "/detokenize": DetokenizeRequest,
            "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest)}


def install_openapi(app: FastAPI, cfg: Any, model: Any) -> None:
    """Replace app.openapi with one that adds the bodies, the query values and the limits of this server
    (cfg: its EngineConfig; model: the gateway's ModelInfo)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            add_bodies(doc, names=model.names, vocab_size=model.vocab_size, max_model_len=model.max_model_len,
                       max_logprobs=cfg.model.max_logprobs, trust_chat_template=cfg.model.trust_request_chat_template)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_bodies(doc: dict[str, Any], *, names: list[str], vocab_size: int, max_model_len: int,
               max_logprobs: int, trust_chat_template: bool = False) -> None:
    from gateway.responses_protocol import INPUT_ITEMS, SCHEMA_MODELS

    bodies = model_bodies()
    models: list[type[BaseModel]] = list(SCHEMA_MODELS)  # the items of ResponsesRequest's input and tools
    for m in bodies.values():
        models += list(m) if isinstance(m, tuple) else [m]
    refs, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(models)], ref_template=REF)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        _limits(schema, names, vocab_size, max_model_len, max_logprobs)
        if not trust_chat_template and "chat_template" in schema.get("properties", {}):
            schema["properties"]["chat_template"]["enum"] = [None]  # 400 without --trust-request-chat-template
        if name == "TokenizeChatRequest":
            schema["properties"]["messages"]["items"] = {"$ref": REF.format(model="ChatMessage")}
        if name == "ResponsesRequest":
            items = {"anyOf": [{"$ref": REF.format(model=m.__name__)} for m in INPUT_ITEMS.values()]}
            schema["properties"]["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                                            "items": items}], "title": "Input"}
    components.update(defs.get("$defs", {}))
    paths = doc.get("paths", {})
    for path, m in bodies.items():
        op = paths.get(path, {}).get("post")
        if op is None:
            continue
        ms = m if isinstance(m, tuple) else (m,)
        schemas = [refs[(x, "validation")] for x in ms]
        _json_body(op, schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    for path, schema in RL_BODIES.items():
        op = paths.get(path, {}).get("post")
        if op is not None:
            _json_body(op, schema, required=bool(schema.get("required", True)))  # anyOf: each one requires
    for (path, name), schema in QUERY.items():
        for op in paths.get(path, {}).values():
            for p in op.get("parameters", []):
                if p.get("name") == name and p.get("in") == "query":
                    p["schema"] = {**schema, "title": p.get("schema", {}).get("title", name)}


def _json_body(op: dict[str, Any], schema: dict[str, Any], required: bool = True) -> None:
    op["requestBody"] = {"required": required, "content": {"application/json": {"schema": schema}}}


def _limits(model: dict[str, Any], names: list[str], vocab: int, max_len: int, max_logprobs: int) -> None:
    """This server's limits on the fields of one model's schema (by field name)."""
    props = model.get("properties", {})
    if "model" in props:  # another name is a 404
        props["model"]["enum"] = [*names, None]
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    ids = {"type": "array", "items": token}
    for name in ("stop_token_ids", "tokens", "trace_decode_token_ids", "allowed_token_ids"):
        if name in props:
            props[name]["items"] = token
    if "token_ids" in props:  # generate's prompt
        props["token_ids"].update(ids, minItems=1, maxItems=max_len - 1)
    if "prompt" in props and "anyOf" in props["prompt"]:  # completions: text, texts, ids, lists of ids
        prompt_ids = {**ids, "minItems": 1, "maxItems": max_len - 1}
        text = {"type": "string", "minLength": 1}  # "" tokenizes to nothing (without a BOS): 400
        props["prompt"] = {"anyOf": [text, {"type": "array", "minItems": 1, "items": text},
                                     prompt_ids, {"type": "array", "minItems": 1, "items": prompt_ids}],
                           "title": "Prompt"}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name]["maximum"] = max_len - 1
    if "truncate_prompt_tokens" in props:
        props["truncate_prompt_tokens"]["maximum"] = max_len
    if max_logprobs >= 0:
        for name in ("logprobs", "prompt_logprobs", "top_logprobs"):
            if name in props and props[name].get("minimum") == -1:
                props[name]["maximum"] = max_logprobs
                props[name]["minimum"] = 0  # -1 asks for the whole vocabulary: above --max-logprobs
