"""The Responses API over HTTP against a real `rollbus serve` (tiny random Qwen3 checkpoint with the real Qwen3
tokenizer and chat template, --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3), through
the official `openai` SDK's `client.responses`: create, stream, tools, retrieve, cancel, previous_response_id; and
agent loops built on it (the SDK's own loop, and pydantic-ai's OpenAIResponsesModel). Outputs are forced by
trace replay (vllm_xargs.trace_decode_token_ids), since a random model calls no tools by itself.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import httpx
import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.fixtures_models import require_qwen3_tokenizer_dir
from tests.serve_process import Server, start_server
from tests.tiny_models import make_tiny_checkpoint

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
CALLS = ('<think>\nThe user wants both.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ONE_CALL = CALLS.split('\n<tool_call>\n{"name": "get_time"')[0]
ANSWER = "<think>\nI have the weather.\n</think>\n\nIt is sunny in Paris."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(require_qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer) -> Server:
    work = tmp_path_factory.mktemp("responses")
    folder = make_tiny_checkpoint("qwen3", work / "qwen3", vocab_size=151936, max_position_embeddings=2048)
    for f in require_qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, folder / f.name)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "2048",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                     "--enable-trace-replay", "--enable-scale-out")
    yield s
    s.stop()


def forced(tok: Tokenizer, text: str) -> dict[str, Any]:
    """The extra body that makes the engine emit exactly `text` (then <|im_end|>)."""
    return {"vllm_xargs": {"trace_decode_token_ids": tok.encode(text) + [tok.token_to_id("<|im_end|>")]}}


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_create_stream_and_retrieve(server: Server, tok: Tokenizer) -> None:
    c = client(server)
    args = dict(model="tiny", input="Weather and time in Paris?", tools=TOOLS, extra_body=forced(tok, CALLS))
    whole = c.responses.create(**args)
    assert whole.status == "completed" and whole.model == "tiny"
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "function_call", "function_call"]
    assert whole.output[0].content[0].text == "\nThe user wants both.\n"
    calls = [(item.name, json.loads(item.arguments)) for item in whole.output[1:]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert whole.usage.output_tokens_details.reasoning_tokens == len(tok.encode("\nThe user wants both.\n"))
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

    text = c.responses.create(model="tiny", input="Hi", extra_body=forced(tok, ANSWER))
    assert text.output_text.strip() == "It is sunny in Paris."


def test_tool_loop_with_previous_response_id(server: Server, tok: Tokenizer) -> None:
    """The SDK's agent loop: the model calls a tool, the client runs it and sends the result as a
    function_call_output item continuing the response; the conversation the engine saw is the one the chat
    template renders for the same messages."""
    c = client(server)
    first = c.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, instructions="Be brief.",
                               extra_body=forced(tok, ONE_CALL))
    (call,) = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = c.responses.create(model="tiny", input=[result], tools=TOOLS, previous_response_id=first.id,
                                extra_body=forced(tok, ANSWER))
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
    c = client(server)
    started = c.responses.create(model="tiny", input="Count to a thousand", background=True,
                                 max_output_tokens=1900, extra_body={"ignore_eos": True})
    assert started.status in ("queued", "in_progress")
    cancelled = c.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(started.id).status == "cancelled"
    done = c.responses.create(model="tiny", input="Hi", max_output_tokens=3)  # the engine goes on
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"


def test_bad_input_is_refused_by_name(server: Server) -> None:
    c = client(server)
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


def test_agent_framework_on_the_responses_api(server: Server, tok: Tokenizer) -> None:
    """pydantic-ai's OpenAIResponsesModel, unmodified: turn 1 calls get_weather (run by the framework), turn 2
    answers from the result. The forced outputs ride on the framework's HTTP client (a request hook adds the
    trace of the turn); everything else is the framework's own request."""
    Agent = pytest.importorskip("pydantic_ai", reason="pip install -e '.[agents]'").Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    turns: list[dict[str, Any]] = []

    async def add_trace(request: httpx.Request) -> None:
        body = json.loads(request.content)
        answered = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body["input"])
        body.update(forced(tok, ANSWER if answered else ONE_CALL))
        turns.append(body)
        request.stream = httpx.ByteStream(json.dumps(body).encode())
        request.headers["content-length"] = str(len(request.stream._stream))

    http = httpx.AsyncClient(event_hooks={"request": [add_trace]}, timeout=60)
    model = OpenAIResponsesModel("tiny", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="x",
                                                                 http_client=http))
    agent = Agent(model)
    seen: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    result = agent.run_sync("Weather in Paris?")
    assert seen == ["Paris"]
    assert result.output.strip() == "It is sunny in Paris."
    assert len(turns) == 2
    outputs = [i for i in turns[1]["input"] if isinstance(i, dict) and i.get("type") == "function_call_output"]
    assert outputs and outputs[0]["output"] == "sunny in Paris"
