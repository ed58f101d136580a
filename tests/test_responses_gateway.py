"""The Responses API (gateway/serving_responses.py) against the scripted fake engine: JSON and streamed
responses hold the same items, the store (retrieve, previous_response_id, eviction, the bound), background
responses (cancel aborts the engine request; a background stream replays from starting_after), forced tool
calls as function_call items, input items as chat messages, and bad input as 400s/404s naming what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.responses_protocol import REFUSED_RESPONSES, items_to_messages
from tests.test_gateway_protocol import FakeClient, make_app
from tests.waits import wait_for

pytestmark = pytest.mark.unit
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def events_of(text: str) -> list[dict[str, Any]]:
    """SSE `event: <type>` / `data: <json>` blocks; the event line names the data's type."""
    out = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}", block
        out.append(event)
    return out


def prompt_of(client: FakeClient, k: int = -1) -> str:
    return "".join(map(chr, client.submitted[k][1]))


def test_json_and_stream_hold_the_same_items_and_the_response_is_stored() -> None:
    http, client = make_app()
    body = http.post("/v1/responses", json={"input": "hi", "instructions": "be brief", "max_output_tokens": 20,
                                            "metadata": {"k": "v"}, "temperature": 0.5}).json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    assert (body["instructions"], body["metadata"], body["temperature"], body["max_output_tokens"]) == \
        ("be brief", {"k": "v"}, 0.5, 20)
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["text"] == "Hello world. Bye."
    assert body["usage"]["output_tokens"] == len("Hello world. Bye.") + 1  # and the EOS
    assert prompt_of(client) == "<system>be brief\n<user>hi\n<assistant>"
    assert http.get(f"/v1/responses/{body['id']}").json() == body

    r = http.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 3})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"] == [events[-2]["item"]] and final["output"][0]["content"][0]["text"] == "Hel"
    assert events[2]["item"]["id"] == final["output"][0]["id"]
    assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_previous_response_id_continues_the_conversation_without_its_instructions() -> None:
    http, client = make_app(FakeClient(script="ok"))
    first = http.post("/v1/responses", json={"input": "a", "instructions": "sys"}).json()
    second = http.post("/v1/responses", json={"input": "b", "previous_response_id": first["id"]}).json()
    assert second["status"] == "completed" and second["previous_response_id"] == first["id"]
    assert prompt_of(client) == "<user>a\n<assistant>ok\n<user>b\n<assistant>"
    http.post("/v1/responses", json={"input": "c", "previous_response_id": second["id"]})
    assert prompt_of(client) == "<user>a\n<assistant>ok\n<user>b\n<assistant>ok\n<user>c\n<assistant>"
    unstored = http.post("/v1/responses", json={"input": "x", "store": False}).json()
    r = http.get(f"/v1/responses/{unstored['id']}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_the_store_is_bounded_and_an_evicted_id_is_a_404_naming_the_limit() -> None:
    http, client = make_app(FakeClient(script="ok"), max_stored_responses=2)
    ids = [http.post("/v1/responses", json={"input": str(i)}).json()["id"] for i in range(3)]
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": ids[0]})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "previous_response_id" and ids[0] in err["message"]
    assert "--max-stored-responses" in err["message"] and "2" in err["message"]
    # the chain of a stored response survives the eviction of its earlier turn's id
    http, client = make_app(FakeClient(script="ok"), max_stored_responses=1)
    one = http.post("/v1/responses", json={"input": "a"}).json()["id"]
    two = http.post("/v1/responses", json={"input": "b", "previous_response_id": one}).json()["id"]
    assert http.get(f"/v1/responses/{one}").status_code == 404
    assert http.post("/v1/responses", json={"input": "c", "previous_response_id": two}).status_code == 200
    assert prompt_of(client) == "<user>a\n<assistant>ok\n<user>b\n<assistant>ok\n<user>c\n<assistant>"
    http, _ = make_app(max_stored_responses=0)
    assert http.post("/v1/responses", json={"input": "a"}).status_code == 200  # store left at its default
    r = http.post("/v1/responses", json={"input": "a", "store": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    r = http.post("/v1/responses", json={"input": "a", "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"


def test_background_response_is_cancelled_and_its_engine_request_aborted() -> None:
    http, client = make_app(FakeClient(script="x" * 60, delay=0.05))
    with http:
        body = http.post("/v1/responses", json={"input": "hi", "background": True}).json()
        assert body["status"] == "queued" and body["background"] is True
        wait_for(lambda: client.submitted, 5, "the engine request")
        assert http.get(f"/v1/responses/{body['id']}").json()["status"] == "in_progress"
        r = http.post(f"/v1/responses/{body['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert client.aborted == [client.submitted[0][0]]
        assert http.get(f"/v1/responses/{body['id']}").json()["status"] == "cancelled"
        again = http.post(f"/v1/responses/{body['id']}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        sync = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
        r = http.post(f"/v1/responses/{sync['id']}/cancel")
        assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
        assert http.app.state.admission.requests == 0 and http.app.state.admission.sequences == 0


def test_background_stream_replays_from_starting_after() -> None:
    http, client = make_app(FakeClient(script="abc", delay=0.01))
    with http:
        r = http.post("/v1/responses", json={"input": "hi", "background": True, "stream": True})
        live = events_of(r.text)
        assert live[-1]["type"] == "response.completed" and live[-1]["response"]["background"] is True
        rid = live[0]["response"]["id"]
        stored = http.get(f"/v1/responses/{rid}").json()
        assert stored["status"] == "completed" and stored["output"] == live[-1]["response"]["output"]
        again = events_of(http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 3}).text)
        assert again == live[4:]
        plain = http.post("/v1/responses", json={"input": "hi", "background": True}).json()
        wait_for(lambda: http.get(f"/v1/responses/{plain['id']}").json()["status"] == "completed", 10, "completion")
        r = http.get(f"/v1/responses/{plain['id']}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_are_function_call_items(stream: bool) -> None:
    http, _ = make_app(FakeClient(script='[{"name": "f", "parameters": {"a": 1}}]'))
    r = http.post("/v1/responses", json={"input": "x", "tools": [TOOL], "tool_choice": "required", "stream": stream})
    body = events_of(r.text)[-1]["response"] if stream else r.json()
    (call,) = body["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"]), call["status"]) == \
        ("function_call", "f", {"a": 1}, "completed")
    assert call["id"].startswith("fc_") and call["call_id"]
    if stream:
        events = events_of(r.text)
        args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert args == call["arguments"]
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert (done["name"], done["arguments"]) == ("f", call["arguments"])
    http, _ = make_app(FakeClient(script='{"a": 2}'))
    body = http.post("/v1/responses", json={"input": "x", "tools": [TOOL],
                                            "tool_choice": {"type": "function", "name": "f"}}).json()
    assert [(c["name"], json.loads(c["arguments"])) for c in body["output"]] == [("f", {"a": 2})]
    assert body["tool_choice"] == {"type": "function", "name": "f"} and body["tools"] == [TOOL]


def test_logprobs_come_with_the_output_text() -> None:
    http, _ = make_app()
    body = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 3, "top_logprobs": 2,
                                            "include": ["message.output_text.logprobs"]}).json()
    lps = body["output"][0]["content"][0]["logprobs"]
    assert [lp["token"] for lp in lps] == list("Hel") and len(lps[0]["top_logprobs"]) == 2
    assert body["top_logprobs"] == 2


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]},
    ]
    assert items_to_messages(items) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "reasoning": "hm", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"}]


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"input": [{"type": "web_search_call", "id": "w"}]}, 400, "input.0.type", "'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type", "text-only"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input.0.call_id", "Field required"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]}, 400, "input.0.encrypted_content",
     "Encrypted content"),
    ({"input": []}, 400, "input", "at least one"),
    ({"input": 5}, 400, "input", "validation error"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "resp_nope"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, 400, "tools.0.type", "'web_search_preview'"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice",
     "does not match"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "objekt"}}]}, 400, "tools.0.parameters", "JSON Schema"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools"}}, 400, "tool_choice.type",
     "'allowed_tools'"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include.0", "reasoning.encrypted_content"),
    ({"input": "x", "logit_bias": {"x": 1.0}}, 400, "logit_bias", "integer token IDs"),
    ({"input": "x", "priority": 1}, 400, "priority", "Priority scheduling is not enabled"),
    ({"input": "x", "max_tool_calls": 3}, 400, "max_tool_calls", "not supported"),
    ({"input": "x", "prompt": {"id": "p"}}, 400, "prompt", "prompt template"),
    ({"input": "x", "background": True, "store": False}, 400, "background", "store"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, 400, "reasoning.summary", "not supported"),
    ({"input": "x", "text": {"verbosity": "low"}}, 400, "text.verbosity", "not supported"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "not supported"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options", "stream=True"),
    ({"input": "x" * 80}, 400, "input", "maximum context length"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature", "validation error"),
])
def test_bad_input_is_refused_naming_it_and_the_engine_goes_on(body: dict, status: int, param: str,
                                                               words: str) -> None:
    http, client = make_app()
    r = http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["code"] == status and not client.submitted  # refused before anything reached the engine
    assert http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}).status_code == 200


ASKING = {"max_tool_calls": 3, "prompt": {"id": "p"}, "mm_processor_kwargs": {"a": 1},
          "enable_response_messages": True, "previous_input_messages": [{"role": "user"}],
          "previous_response": {"id": "resp_1"}, "conversation": "conv_1", "context_management": [{"type": "x"}]}


@pytest.mark.parametrize("field", sorted(REFUSED_RESPONSES))
def test_every_refused_field_is_a_400_naming_it(field: str) -> None:
    http, client = make_app()
    r = http.post("/v1/responses", json={"input": "x", field: ASKING[field]})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"] and not client.submitted


def test_an_engine_failure_is_an_error_event_or_a_failed_background_response() -> None:
    client = FakeClient()
    client.fail_after = 2
    http, _ = make_app(client)
    with http:
        events = events_of(http.post("/v1/responses", json={"input": "x", "stream": True}).text)
        assert events[-1]["type"] == "error" and events[-1]["code"] == "500", events[-1]
        assert "worker exploded" in events[-1]["message"]
        assert http.get(f"/v1/responses/{events[0]['response']['id']}").status_code == 404  # nothing finished
        r = http.post("/v1/responses", json={"input": "x"})
        assert r.status_code == 500 and "worker exploded" in r.json()["error"]["message"]
        rid = http.post("/v1/responses", json={"input": "x", "background": True}).json()["id"]
        wait_for(lambda: http.get(f"/v1/responses/{rid}").json()["status"] == "failed", 10, "the failure")
        assert "worker exploded" in http.get(f"/v1/responses/{rid}").json()["error"]["message"]


def test_the_data_parallel_rank_header_is_read_on_responses_too() -> None:
    http, client = make_app()
    r = http.post("/v1/responses", json={"input": "x"}, headers={"X-data-parallel-rank": "3"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-data-parallel-rank", r.text
    assert not client.submitted
    assert http.post("/v1/responses", json={"input": "x"}, headers={"X-data-parallel-rank": "0"}).status_code == 200


def test_logit_bias_and_priority_reach_the_engine_as_on_chat() -> None:
    http, client = make_app(scheduling_policy="priority")
    r = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, "logit_bias": {"5": 150},
                                         "priority": -1})
    assert r.status_code == 200, r.text
    params = client.submitted[-1][2]
    assert params.logit_bias == {5: 100.0} and params.priority == -1  # clamped to [-100, 100], as vLLM
