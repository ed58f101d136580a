"""Forced JSON that closes: a forced tool choice and a `response_format` json_schema allow no free whitespace
between JSON tokens by default (a small model at temperature 1 otherwise spends max_tokens on whitespace),
the request's structured_outputs gives vLLM's flexible whitespace back, and an output that max_tokens still
cuts is returned as far as it goes, never as an empty message."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from engine.structured_outputs import grammar_text
from gateway.forced_tools import forced_tool_calls
from gateway.protocol import ChatCompletionRequest
from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import start_server

WEATHER = {"type": "object", "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
# a name has a length: without maxLength nothing in a grammar can end a string the model keeps writing (seed 9
# writes French prose into "name" for all 96 tokens); whitespace and unnamed keys are what the defaults close
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def _whitespace_flexible(so) -> bool:
    return json.loads(grammar_text(so))["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"]


def _closed(so) -> bool:
    """Whether the top-level object of the schema (or the tools' parameters) allows no other keys."""
    schema = json.loads(grammar_text(so))["grammars"][0]["json_schema"]
    if schema.get("type") == "array":  # "required": the parameters of the first tool
        schema = schema["items"]["anyOf"][0]["properties"]["parameters"]
    return schema.get("additionalProperties") is False


@pytest.mark.unit
@pytest.mark.parametrize("extra, flexible", [
    ({}, False),
    ({"structured_outputs": {"disable_any_whitespace": False}}, True),
    ({"structured_outputs": {"disable_any_whitespace": True}}, False),
    ({"structured_outputs": {"whitespace_pattern": "[ ]?"}}, True),
    ({"guided_whitespace_pattern": "[ ]?"}, True),
])
@pytest.mark.parametrize("forced", ["tools", "schema"])
def test_forced_json_has_no_free_whitespace_unless_the_request_asks(forced, extra, flexible) -> None:
    body = {"messages": MESSAGES, **extra}
    body.update({"tools": TOOLS, "tool_choice": "required"} if forced == "tools" else
                {"response_format": SCHEMA_FORMAT})
    so = ChatCompletionRequest.model_validate(body).constraint()
    assert _whitespace_flexible(so) is flexible
    assert _closed(so)  # vLLM's default backend (xgrammar) is strict about unnamed keys
    if "whitespace_pattern" in str(extra):
        assert so.whitespace_pattern == "[ ]?"


@pytest.mark.unit
@pytest.mark.parametrize("forced", ["tools", "schema"])
def test_forced_json_may_allow_unnamed_keys_again(forced) -> None:
    body = {"messages": MESSAGES, "structured_outputs": {"disable_additional_properties": False}}
    body.update({"tools": TOOLS, "tool_choice": "required"} if forced == "tools" else
                {"response_format": SCHEMA_FORMAT})
    assert not _closed(ChatCompletionRequest.model_validate(body).constraint())


@pytest.mark.unit
def test_other_json_constraints_keep_vllms_flexible_whitespace() -> None:
    for body in ({"structured_outputs": {"json": PERSON}}, {"response_format": {"type": "json_object"}},
                 {"guided_json": PERSON}):
        so = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body}).constraint()
        assert _whitespace_flexible(so) is True, body
        assert not _closed(so), body


@pytest.mark.unit
def test_a_bad_whitespace_option_of_a_forced_tool_call_is_named() -> None:
    from bus.sampling_params import ParamError

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "structured_outputs": {"disable_any_whitespace": "no"}}
    with pytest.raises(ParamError) as e:
        ChatCompletionRequest.model_validate(body).constraint()
    assert e.value.param == "structured_outputs.disable_any_whitespace"


@pytest.mark.unit
@pytest.mark.parametrize("text, calls", [
    ('[{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
    ('[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},{"name":"get_weather","param',
     [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_weather", "")]),  # as the stream sent them
    ('[{"name": "get_wea', []),
    ('[{"name": "get_weather", ', [("get_weather", "")]),
])
def test_a_cut_required_call_is_returned_as_far_as_it_goes(text, calls) -> None:
    got = forced_tool_calls("required", text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls


# --- served: the bar, through the official openai SDK ----------------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_dir):  # noqa: F811
    s = start_server(tmp_path_factory.mktemp("forced-json"), str(smollm2_dir), "--max-model-len", "1024",
                     "--max-num-seqs", "40", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.mark.timeout(900)
def test_20_of_20_forced_calls_and_schemas_parse_at_temperature_1(smol) -> None:
    """tool_choice="required" and json_schema, seeds 0-19, max_tokens 96 at temperature 1 on SmolLM2: every
    result is a valid, parseable object (the 40 requests run as one batch)."""
    from openai import OpenAI

    client = OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(job: tuple[str, int]):
        kind, seed = job
        extra = {"tools": TOOLS, "tool_choice": "required"} if kind == "tools" else {"response_format": SCHEMA_FORMAT}
        return kind, client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=96, temperature=1.0,
                                                    seed=seed, **extra).choices[0]

    jobs = [(kind, seed) for kind in ("tools", "schema") for seed in range(20)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    bad = []
    for (kind, seed), (_, choice) in zip(jobs, results):
        try:
            if kind == "tools":
                assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
                for call in choice.message.tool_calls:
                    assert call.function.name == "get_weather"
                    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            else:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), PERSON)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((kind, seed, choice.finish_reason, choice.message, repr(e)[:200]))
    assert not bad, "\n".join(map(str, bad))


def test_a_forced_call_cut_by_max_tokens_is_returned_partial(smol) -> None:
    """max_tokens too small for the call: finish_reason "length" with the call as far as it went (streamed
    and whole agree), never an empty message."""
    from openai import OpenAI

    client = OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    common = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    for max_tokens in (3, 12):
        whole = client.chat.completions.create(max_tokens=max_tokens, **common).choices[0]
        assert whole.finish_reason == "length"
        assert whole.message.tool_calls or whole.message.content, whole
        args = ""
        content = ""
        for chunk in client.chat.completions.create(max_tokens=max_tokens, stream=True, **common):
            delta = chunk.choices[0].delta if chunk.choices else None
            for d in (delta and delta.tool_calls) or []:
                args += d.function.arguments or ""
            content += (delta and delta.content) or ""
        if whole.message.tool_calls:
            assert whole.message.tool_calls[0].function.name == "get_weather"
            assert args == whole.message.tool_calls[0].function.arguments
        else:
            assert content == whole.message.content
