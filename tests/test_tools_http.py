"""Tool calling and reasoning over HTTP against a real `rollbus serve` (tiny random Qwen3 checkpoint with the
real Qwen3 tokenizer and chat template, --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3): outputs are forced by trace replay (vllm_xargs.trace_decode_token_ids,
--enable-trace-replay), since a random model calls no tools by itself. Streamed and non-streamed responses
through the openai SDK agree; the next turn renders the calls and results; bad input is a 400 naming the
field and the server goes on; a real agent framework (pydantic-ai) runs a two-turn tool loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.fixtures_models import require_qwen3_tokenizer_dir
from tests.serve_process import Server
from tests.server_helpers import ANSWER, TOOL_CALLS, forced, qwen3_tool_server, run_weather_agent

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALLS = TOOL_CALLS
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(require_qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer) -> Server:
    s = qwen3_tool_server(tmp_path_factory.mktemp("tools"))
    yield s
    s.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_stream_equals_non_stream(server: Server, tok: Tokenizer) -> None:
    c = client(server)
    args = dict(model="tiny", messages=USER, tools=TOOLS, extra_body={**forced(tok, CALLS), "return_token_ids": True})
    whole = c.chat.completions.create(**args)
    msg = whole.choices[0].message
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(t.id.startswith("chatcmpl-tool-") and t.type == "function" for t in msg.tool_calls)
    assert msg.content is None and msg.model_extra["reasoning"] == "\nThe user wants both.\n"
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(tok.encode("\nThe user wants both.\n"))
    assert tok.decode(whole.choices[0].model_extra["token_ids"], skip_special_tokens=False).startswith(CALLS)

    calls: dict[int, dict[str, str]] = {}
    reasoning = content = ""
    pieces_of = {0: 0, 1: 0}
    for chunk in c.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += d.model_extra.get("reasoning") or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
                if t.id:
                    assert not call["id"] and not call["arguments"]  # the id and name come first, once
                    call["id"], call["name"] = t.id, t.function.name
                else:
                    assert t.function.name is None and call["name"]
                    pieces_of[t.index] += 1
                call["arguments"] += t.function.arguments or ""
    assert reasoning == msg.model_extra["reasoning"] and content == ""
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert min(pieces_of.values()) > 2  # the arguments arrived in several deltas


def test_tool_results_render_into_the_next_turn(server: Server, tok: Tokenizer) -> None:
    """The assistant's calls and the tool messages go through the chat template (POST .../render)."""
    first = client(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                   extra_body=forced(tok, CALLS)).choices[0].message
    history = [*USER, first.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": t.id, "content": f"result of {t.function.name}"}
                 for t in first.tool_calls)]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                              "return_token_ids": True, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nresult of get_weather\n</tool_response>" in prompt
    assert "<tool_response>\nresult of get_time\n</tool_response>" in prompt


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters", "not a valid JSON Schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "vllm_xargs": {"other": 1}}, "vllm_xargs", "not supported"),
])
def test_bad_input_is_a_400_naming_the_field(server: Server, body: dict, param: str, words: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200  # the engine goes on serving


def test_tool_choice_none_returns_the_text(server: Server, tok: Tokenizer) -> None:
    msg = client(server).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none",
                                                 extra_body=forced(tok, CALLS)).choices[0].message
    assert not msg.tool_calls and "<tool_call>" in msg.content


def test_agent_framework_two_turn_tool_loop(server: Server, tok: Tokenizer) -> None:
    """pydantic-ai's OpenAIChatModel, unmodified, against rollbus (tests.server_helpers.run_weather_agent)."""
    pytest.importorskip("pydantic_ai", reason="pip install -e '.[agents]'")
    from pydantic_ai.models.openai import OpenAIChatModel

    output, seen, turns = run_weather_agent(server, tok, OpenAIChatModel,
                                            lambda body: any(m.get("role") == "tool" for m in body["messages"]))
    assert seen == ["Paris"]
    assert output.strip() == "It is sunny in Paris."  # content keeps the "\n\n" after </think>, as vLLM
    assert len(turns) == 2
    tool_msgs = [m for m in turns[1]["messages"] if m["role"] == "tool"]
    assert tool_msgs and tool_msgs[0]["content"] == "sunny in Paris"


def test_exact_token_tool_loop_over_generate(server: Server, tok: Tokenizer) -> None:
    """docs/tokens.md's loop (the outputs forced by trace replay): the kept stream is the first prompt, the
    model's tokens and only the template's text between turns; the history renders the same with the tool
    results after it; the chat endpoint's own re-rendering of turn 2 starts with the same tokens."""
    base = server.url
    end_id = tok.token_to_id("<|im_end|>")
    messages: list[dict[str, Any]] = list(USER)

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        body = {"messages": msgs, "tools": TOOLS, "add_generation_prompt": generation_prompt}
        r = httpx.post(f"{base}/tokenize", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    tokens = render(messages, True)
    first_prompt = list(tokens)
    outputs = []
    for turn, forced_text in enumerate([CALLS.split("\n<tool_call>\n{\"name\": \"get_time\"")[0], ANSWER]):
        trace = tok.encode(forced_text) + [end_id]
        r = httpx.post(f"{base}/inference/v1/generate", timeout=120, json={
            "token_ids": tokens, "sampling_params": {"trace_decode_token_ids": trace,
                                                      "skip_special_tokens": False}})
        assert r.status_code == 200, r.text
        gen = r.json()["choices"][0]["token_ids"]
        assert gen == trace
        outputs.append(gen)
        tokens = tokens + gen
        text = tok.decode(gen, skip_special_tokens=False)
        calls = [json.loads(c) for c in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)]
        if not calls:
            break
        messages.append({"role": "assistant", "content": text.split("<tool_call>")[0].removesuffix("<|im_end|>"),
                         "tool_calls": [{"id": f"call-{turn}-{i}", "type": "function",
                                         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                        for i, c in enumerate(calls)]})
        before = render(messages, False)
        messages += [{"role": "tool", "tool_call_id": f"call-{turn}-{i}", "content": "sunny"}
                     for i, c in enumerate(calls)]
        after = render(messages, True)
        cut = len(before) - before[::-1].index(end_id)
        assert after[:cut] == before[:cut]
        tokens = tokens + after[cut:]
    assert len(outputs) == 2
    between = tokens[len(first_prompt) + len(outputs[0]):len(tokens) - len(outputs[1])]
    assert tok.decode(between, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # here the template reproduces the model's turn (json.dumps spacing, reasoning of the current turn
    # kept), so the chat endpoint's own rendering of turn 2 is the same token stream
    rerendered = render(messages, True)
    assert rerendered == tokens[:len(tokens) - len(outputs[1])]
