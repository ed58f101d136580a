"""The Responses API over HTTP against a real `rollbus serve` (tiny random Qwen3 checkpoint with the real Qwen3
tokenizer and chat template, --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3), through
the official `openai` SDK's `client.responses`: create, stream, tools, retrieve, cancel, previous_response_id; and
agent loops built on it (the SDK's own loop, and pydantic-ai's OpenAIResponsesModel). Outputs are forced by
trace replay (vllm_xargs.trace_decode_token_ids), since a random model calls no tools by itself.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.serve_process import Server
from tests.server_helpers import (
    ANSWER,
    ONE_TOOL_CALL,
    TOOL_CALLS,
    forced,
    openai_client,
    qwen3_tool_server,
    run_weather_agent,
)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
CALLS, ONE_CALL = TOOL_CALLS, ONE_TOOL_CALL


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen3_tok: Tokenizer) -> Server:
    s = qwen3_tool_server(tmp_path_factory.mktemp("responses"))
    yield s
    s.stop()


def test_create_stream_and_retrieve(server: Server, qwen3_tok: Tokenizer) -> None:
    c = openai_client(server)
    args = dict(model="tiny", input="Weather and time in Paris?", tools=TOOLS, extra_body=forced(qwen3_tok, CALLS))
    whole = c.responses.create(**args)
    assert whole.status == "completed" and whole.model == "tiny"
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "function_call", "function_call"]
    assert whole.output[0].content[0].text == "\nThe user wants both.\n"
    calls = [(item.name, json.loads(item.arguments)) for item in whole.output[1:]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert whole.usage.output_tokens_details.reasoning_tokens == len(qwen3_tok.encode("\nThe user wants both.\n"))
    assert c.responses.retrieve(whole.id).model_dump() == whole.model_dump()

    with c.responses.stream(**args) as stream:
        kinds_seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds_seen[:2] == ["response.created", "response.in_progress"] and kinds_seen[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds_seen and "response.function_call_arguments.delta" in kinds_seen
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    assert c.responses.retrieve(final.id).output[1].call_id == final.output[1].call_id

    text = c.responses.create(model="tiny", input="Hi", extra_body=forced(qwen3_tok, ANSWER))
    assert text.output_text.strip() == "It is sunny in Paris."


def test_tool_loop_with_previous_response_id(server: Server, qwen3_tok: Tokenizer) -> None:
    """The SDK's agent loop: the model calls a tool, the client runs it and sends the result as a
    function_call_output item continuing the response; the conversation the engine saw is the one the chat
    template renders for the same messages."""
    c = openai_client(server)
    first = c.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, instructions="Be brief.",
                               extra_body=forced(qwen3_tok, ONE_CALL))
    (call,) = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = c.responses.create(model="tiny", input=[result], tools=TOOLS, previous_response_id=first.id,
                                extra_body=forced(qwen3_tok, ANSWER))
    assert second.output_text.strip() == "It is sunny in Paris." and second.previous_response_id == first.id
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "reasoning_content": "\nThe user wants both.\n",
                "tool_calls": [{"id": call.call_id, "type": "function",
                                "function": {"name": "get_weather", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    r = httpx.post(server.url + "/v1/chat/completions/render", timeout=60,
                   json={"model": "tiny", "messages": history, "tools": chat_tools})
    assert r.status_code == 200, r.text
    assert second.usage.input_tokens == len(r.json()["token_ids"])  # instructions do not carry over


def test_background_cancel(server: Server) -> None:
    c = openai_client(server)
    started = c.responses.create(model="tiny", input="Count to a thousand", background=True,
                                 max_output_tokens=1900, extra_body={"ignore_eos": True})
    assert started.status in ("queued", "in_progress")
    cancelled = c.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(started.id).status == "cancelled"
    done = c.responses.create(model="tiny", input="Hi", max_output_tokens=3)  # the engine goes on
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"


def test_bad_input_is_refused_by_name(server: Server) -> None:
    c = openai_client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="tiny", input="x", previous_response_id="resp_gone")
    assert "resp_gone" in e.value.message and "--max-stored-responses" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input=[{"type": "computer_call_output", "call_id": "c", "output": {}}])
    assert e.value.body["param"] == "input.0.type" and "computer_call_output" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="x", tools=[{"type": "web_search_preview"}])
    assert e.value.body["param"] == "tools.0.type"
    assert c.responses.create(model="tiny", input="x", max_output_tokens=2).status == "incomplete"


def test_agent_framework_on_the_responses_api(server: Server, qwen3_tok: Tokenizer) -> None:
    """pydantic-ai's OpenAIResponsesModel, unmodified: a two-turn tool loop on the Responses API
    (tests.server_helpers.run_weather_agent)."""
    pytest.importorskip("pydantic_ai", reason="pip install -e '.[agents]'")
    from pydantic_ai.models.openai import OpenAIResponsesModel

    def answered(body: dict[str, Any]) -> bool:
        return any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body["input"])

    output, seen, turns = run_weather_agent(server, qwen3_tok, OpenAIResponsesModel, answered)
    assert seen == ["Paris"]
    assert output.strip() == "It is sunny in Paris."
    assert len(turns) == 2 and all(isinstance(t["input"], list) for t in turns)
    outputs = [i for i in turns[1]["input"] if isinstance(i, dict) and i.get("type") == "function_call_output"]
    assert outputs and outputs[0]["output"] == "sunny in Paris"
