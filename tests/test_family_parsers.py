"""The tool-call and reasoning parsers of DeepSeek-V3 / V3.1, Kimi-K2, GLM-4.5, gpt-oss (harmony) and Mistral
(issue 34), on outputs written in each family's own format:
- Mistral's strings are what mistral_common 1.13 (the tokenizer vLLM uses) renders for an assistant turn with
  two calls: its v3 SentencePiece tokenizer (JSON-list form, the "▁" decoded to a space), and its tekken
  tokenizer as v11 (with [CALL_ID]) and v13;
- DeepSeek-V3's is its chat template's rendering of tool calls (tokenizer_config.json of DeepSeek-V3 / R1),
  V3.1's, Kimi-K2's and GLM-4.5's are their templates' (as quoted by vLLM's and other projects' parser
  fixtures: the model repositories are not reachable from here); gpt-oss's follow openai/harmony's test data.
Every output is streamed in several ways (one character a delta; three; markers whole and text a character at
a time, as special tokens arrive) and must reassemble to the whole-output result; every prefix of every output
(a cut-off or malformed one) is parsed without an exception.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.chat_parsing import ChatOutputParser, ParserConfig
from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.tool_parsers import TOOL_PARSERS

pytestmark = pytest.mark.unit

W = {"city": "Paris", "days": 3}
T = {"tz": "CET"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]

DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3 = (f"Let me check.{DS_B}{DS_CB}function{DS_SEP}get_weather\n```json\n{json.dumps(W)}\n```{DS_CE}\n"
               f"{DS_CB}function{DS_SEP}get_time\n```json\n{json.dumps(T)}\n```{DS_CE}{DS_E}")
DEEPSEEK_V31 = (f"{DS_B}{DS_CB}get_weather{DS_SEP}{json.dumps(W)}{DS_CE}{DS_CB}get_time{DS_SEP}{json.dumps(T)}{DS_CE}"
                f"{DS_E}")
KIMI = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{json.dumps(W)}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        f"{json.dumps(T)}<|tool_call_end|><|tool_calls_section_end|>")
GLM = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n"
       "</tool_call>")
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abcDEF123"}, '
              '{"name": "get_time", "arguments": {"tz": "CET"}, "id": "xyz789QWE"}]')
MISTRAL_V11 = ('Let me check.[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris", "days": 3}'
               '[TOOL_CALLS]get_time[CALL_ID]xyz789QWE[ARGS]{"tz": "CET"}')
MISTRAL_V13 = ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
               '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')
HARMONY = ("<|channel|>analysis<|message|>Need the weather, then the time.<|end|><|start|>assistant"
           '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}'
           '<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz":"CET"}<|call|>')
HARMONY_TEXT = ("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>commentary<|message|>Hi!"
                "<|end|><|start|>assistant<|channel|>final<|message|>Paris is sunny.")
THINK = "<think>\nThe user wants weather.\n</think>\n\n"

# (name, output, tool parser, reasoning parser, chat_template_kwargs, expected whole: reasoning, content, calls)
CASES: list[tuple[str, str, str | None, str | None, dict[str, Any], tuple]] = [
    ("deepseek_v3 two calls", DEEPSEEK_V3, "deepseek_v3", None, {}, (None, "Let me check.", [W, T])),
    ("deepseek_v31 two calls", DEEPSEEK_V31, "deepseek_v31", None, {}, (None, None, [W, T])),
    ("deepseek_v31 thinking", THINK + DEEPSEEK_V31, "deepseek_v31", "deepseek_v3", {"thinking": True},
     ("\nThe user wants weather.\n", None, [W, T])),
    ("deepseek_v3 reasoning off", "<think>x</think>y", None, "deepseek_v3", {}, (None, "<think>x</think>y", [])),
    ("kimi_k2 calls", KIMI, "kimi_k2", None, {}, (None, None, [W, T])),
    ("kimi_k2 thinking then calls", "The user wants weather. " + KIMI, "kimi_k2", "kimi_k2", {},
     ("The user wants weather.", None, [W, T])),
    ("kimi_k2 think tags", "<think>hmm\n</think>Sunny.", None, "kimi_k2", {}, ("hmm", "Sunny.", [])),
    ("kimi_k2 thinking off", "<think>hmm</think>Sunny.", None, "kimi_k2", {"thinking": False},
     (None, "<think>hmm</think>Sunny.", [])),
    ("glm45 calls", "Sure.\n" + GLM, "glm45", None, {}, (None, "Sure.", [W, T])),
    ("glm45 thinking then calls", THINK + GLM, "glm45", "glm45", {}, ("\nThe user wants weather.", None, [W, T])),
    ("glm45 unknown tool", "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "glm45",
     None, {}, (None, "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", [])),
    ("mistral v3 JSON list", MISTRAL_V3, "mistral", None, {}, (None, None, [W, T])),
    ("mistral v11 with ids", MISTRAL_V11, "mistral", None, {}, (None, "Let me check.", [W, T])),
    ("mistral v13", MISTRAL_V13, "mistral", None, {}, (None, "Let me check.", [W, T])),
    ("mistral text", "No tools needed.", "mistral", None, {}, (None, "No tools needed.", [])),
    ("mistral name{args} and trailing text", '[TOOL_CALLS]get_time{"tz": "CET"} done', "mistral", None, {},
     (None, None, [T])),
    ("deepseek_v31 text", "Just text.", "deepseek_v31", None, {}, (None, "Just text.", [])),
    ("kimi_k2 content, calls, text after", "I'll check. " + KIMI + " bye", "kimi_k2", None, {},
     (None, "I'll check. ", [W, T])),
    ("glm45 call without arguments", "<tool_call>get_time</tool_call>", "glm45", None, {}, (None, None, [{}])),
    ("glm45 thinking off", "Sunny.", "glm45", "glm45", {"enable_thinking": False}, (None, "Sunny.", [])),
    ("kimi_k2 cut in the arguments", KIMI[:KIMI.index('"days"')], "kimi_k2", None, {}, (None, None, [...])),
    ("glm45 cut in a value", GLM[:GLM.index("3</arg_value>") + 1], "glm45", None, {},
     (None, None, [{"city": "Paris"}])),
    ("harmony calls", HARMONY, "openai", "openai_gptoss", {}, ("Need the weather, then the time.", None, [W, T])),
    ("harmony text", HARMONY_TEXT, "openai", "openai_gptoss", {}, ("Simple.", "Hi!\nParis is sunny.", [])),
    ("harmony reasoning parser alone", HARMONY_TEXT, None, "openai_gptoss", {},
     ("Simple.", "Hi!\nParis is sunny.", [])),
    ("harmony cut in a header", "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin", "openai",
     "openai_gptoss", {}, ("ok", "<|start|>assistant<|channel|>fin", [])),
]
_MARKER = re.compile(r"<[|｜][^<>]*?[|｜]>|\[[A-Z_/]+\]")


class FakeTokenizer:
    """Just the vocabulary look-ups the reasoning parsers make (the markers are matched as text)."""

    VOCAB = {"<think>": 1, "</think>": 2}

    def token_to_id(self, token: str) -> int | None:
        return self.VOCAB.get(token)


def _config(case: tuple) -> ParserConfig:
    _, _, tp, rp, kwargs, _ = case
    return ParserConfig(tool_parser=tp, reasoning_parser=rp, tool_choice_auto=tp is not None,
                        chat_template_kwargs=kwargs, tools=TOOLS)


def _chunkings(text: str) -> dict[str, list[str]]:
    pieces = [p for m in re.split(f"({_MARKER.pattern})", text) if m
              for p in ([m] if _MARKER.fullmatch(m) else list(m))]
    return {"1": list(text), "3": [text[k:k + 3] for k in range(0, len(text), 3)], "markers whole": pieces}


def whole(case: tuple) -> dict[str, Any]:
    parser = ChatOutputParser(_config(case), FakeTokenizer(), [])
    p = parser.parse(case[1])
    return {"reasoning": p.reasoning, "content": p.content, "calls": [(c.name, c.arguments) for c in p.tool_calls]}


def streamed(case: tuple, chunks: list[str], strict: bool = True) -> dict[str, Any]:
    parser = ChatOutputParser(_config(case), FakeTokenizer(), [])
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for k, piece in enumerate(chunks):
        d = parser.parse_delta(piece, finished=k == len(chunks) - 1)
        if d is None:
            continue
        reasoning, content = reasoning + (d.reasoning or ""), content + (d.content or "")
        for c in d.tool_calls:
            # the name comes alone with the id (at the end of a cut-off output the rest may join it, as vLLM)
            assert (c.id is not None) == (c.name is not None) and not (strict and c.name and c.arguments), c
            call = calls.setdefault(c.index, ["", ""])
            call[0] += c.name or ""
            call[1] += c.arguments or ""
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_whole_result(case: tuple) -> None:
    got = whole(case)
    reasoning, content, calls = case[5]
    assert (got["reasoning"], got["content"]) == (reasoning, content)
    assert [c[0] for c in got["calls"]] == [("get_time" if a in (T, {}) else "get_weather") for a in calls]
    if calls != [...]:  # [...]: a call whose arguments were cut off (not JSON)
        assert [json.loads(c[1]) for c in got["calls"]] == calls


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_reassembles_to_the_whole_result(case: tuple) -> None:
    want = whole(case)
    for how, chunks in _chunkings(case[1]).items():
        got = streamed(case, chunks)
        if case[2] == "openai":  # harmony: the whole result re-serialises the arguments (vLLM), the stream not
            got["calls"] = [(n, json.dumps(json.loads(a))) for n, a in got["calls"]]
        assert got == want, how


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cut_off_and_malformed_outputs_never_raise(case: tuple) -> None:
    text = case[1]
    for end in range(len(text)):
        whole((*case[:1], text[:end], *case[2:]))
        streamed((*case[:1], text[:end], *case[2:]), list(text[:end]) or [""], strict=False)


def _case(name: str) -> tuple:
    return next(c for c in CASES if c[0] == name)


def test_ids_and_arguments_as_vllm() -> None:
    kimi = ChatOutputParser(_config(_case("kimi_k2 calls")), FakeTokenizer(), []).parse(KIMI)
    assert [c.id for c in kimi.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]  # Kimi's own ids
    v11 = ChatOutputParser(_config(_case("mistral v11 with ids")), FakeTokenizer(), []).parse(MISTRAL_V11)
    assert [c.id for c in v11.tool_calls] == ["abcDEF123", "xyz789QWE"]
    v13 = ChatOutputParser(_config(_case("mistral v13")), FakeTokenizer(), []).parse(MISTRAL_V13)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in v13.tool_calls)  # Mistral's templates need these
    ds = ChatOutputParser(_config(_case("deepseek_v3 two calls")), FakeTokenizer(), []).parse(DEEPSEEK_V3)
    assert ds.tool_calls[0].arguments == json.dumps(W)  # as the model wrote it
    glm = ChatOutputParser(_config(_case("glm45 calls")), FakeTokenizer(), []).parse(GLM)
    assert glm.tool_calls[0].arguments == '{"city": "Paris", "days": 3}'  # typed by the schema
    untyped = ChatOutputParser(ParserConfig(tool_parser="glm45", tool_choice_auto=True), FakeTokenizer(), [])
    assert json.loads(untyped.parse(GLM).tool_calls[0].arguments) == {"city": "Paris", "days": "3"}
    harmony = ChatOutputParser(_config(_case("harmony calls")), FakeTokenizer(), []).parse(HARMONY)
    assert harmony.tool_calls[0].arguments == '{"city": "Paris", "days": 3}'  # vLLM: json.dumps(json.loads(body))


@pytest.mark.parametrize(("tool_parser", "text", "content"), [
    ("deepseek_v3", f"Hi{DS_B}{DS_CB}function{DS_SEP}f\n```json\n{{\"a\": 1", None),  # cut off: no call (vLLM)
    ("deepseek_v31", f"{DS_B}{DS_CB}f{DS_SEP}{{\"a\": 1}}", None),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}", None),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}", None),
    ("mistral", "[TOOL_CALLS] [1, 2]", None),
])
def test_unparsable_calls_stay_content(tool_parser: str, text: str, content: None) -> None:
    cfg = ParserConfig(tool_parser=tool_parser, tool_choice_auto=True, tools=TOOLS)
    got = ChatOutputParser(cfg, FakeTokenizer(), []).parse(text)
    assert (got.content, got.tool_calls) == (text, [])


def test_cut_off_calls_kept_as_vllm_keeps_them() -> None:
    """Kimi and GLM (vLLM's engine parsers) keep a call cut off by max_tokens with what it has so far."""
    cut = KIMI[:KIMI.index("<|tool_call_end|>")]
    kimi = ChatOutputParser(_config(_case("kimi_k2 calls")), FakeTokenizer(), []).parse(cut)
    assert [(c.name, c.arguments) for c in kimi.tool_calls] == [("get_weather", json.dumps(W))]
    glm = ChatOutputParser(_config(_case("glm45 calls")), FakeTokenizer(), []).parse(GLM[:GLM.index("<arg_key>days")])
    assert [(c.name, json.loads(c.arguments)) for c in glm.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_markers_reach_the_parsers() -> None:
    """The markers are special tokens: these parsers keep them in the decoded text (vLLM's adjust_request)."""
    for tp, rp in (("deepseek_v3", None), ("kimi_k2", "kimi_k2"), ("glm45", "glm45"), ("mistral", None),
                   ("openai", None), (None, "openai_gptoss")):
        cfg = ParserConfig(tool_parser=tp, reasoning_parser=rp, tool_choice_auto=tp is not None)
        assert ChatOutputParser(cfg, FakeTokenizer(), []).skip_special_tokens(True) is False, (tp, rp)


def test_harmony_reasoning_token_count() -> None:
    vocab = {t: i for i, t in enumerate(["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "analysis",
                                         "commentary", " to=functions.f", "final", "a", "b", "{}", "assistant"])}

    class Tok(FakeTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(t for i in ids for t, j in vocab.items() if j == i)

    ids = [vocab[t] for t in ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>", "assistant",
                              "<|channel|>", "commentary", " to=functions.f", "<|message|>", "{}", "<|call|>",
                              "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "a"]]
    parser = ChatOutputParser(ParserConfig(reasoning_parser="openai_gptoss"), Tok(), [])
    assert parser.reasoning_tokens(ids) == 3  # vLLM: analysis and call bodies, markers not counted


def test_harmony_refuses_other_parsers_beside_it() -> None:
    from engine.config.model import ModelConfig, _check_parsers

    with pytest.raises(ValueError, match="--tool-call-parser openai"):
        _check_parsers(ModelConfig(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="qwen3"),
                       tokens_only=False)
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss"):
        _check_parsers(ModelConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                   reasoning_parser="openai_gptoss"), tokens_only=False)
    _check_parsers(ModelConfig(enable_auto_tool_choice=True, tool_call_parser="openai",
                               reasoning_parser="openai_gptoss"), tokens_only=False)


def test_every_parser_is_in_the_docs_table_and_the_help() -> None:
    from engine.config import new_parser

    doc = Path(__file__).parent.parent.joinpath("docs/tools.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    for name in TOOL_PARSERS:
        assert any(f"`{name}`" in r.split("|")[1] for r in rows), name
    for name in REASONING_PARSERS:
        assert any(f"`{name}`" in r.split("|")[1] for r in rows), name
    help_text = new_parser().format_help()
    assert all(n in help_text for n in [*TOOL_PARSERS, *REASONING_PARSERS])


FN = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_chat_route_mistral_calls_streamed_and_not() -> None:
    from tests.test_chat_parsing import reassemble
    from tests.test_gateway_protocol import FakeClient, make_app, sse_events

    script = 'Hi[TOOL_CALLS]f[ARGS]{"a": 1}'
    http, _ = make_app(FakeClient(script), enable_auto_tool_choice=True, tool_call_parser="mistral")
    body = {"messages": [{"role": "user", "content": ""}], "tools": FN, "max_tokens": len(script) + 3}
    got = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] == "Hi"
    (call,) = got["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and len(call["id"]) == 9
    events = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [{"delta": c["choices"][0]["delta"], "finish_reason": c["choices"][0]["finish_reason"]}
              for c in events[1:-1]]
    streamed_call = reassemble(deltas)
    assert streamed_call["content"] == "Hi" and streamed_call["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed_call["tool_calls"]] == [("f", '{"a": 1}')]


def test_chat_route_harmony_channels() -> None:
    """gpt-oss's channels through the chat route (one character a delta; the fake model's context is short)."""
    from tests.test_gateway_protocol import FakeClient, make_app, sse_events

    script = "<|channel|>final<|message|>Hi"
    http, fake = make_app(FakeClient(script), reasoning_parser="openai_gptoss")
    body = {"messages": [{"role": "user", "content": ""}], "max_tokens": len(script) + 3}
    got = http.post("/v1/chat/completions", json=body).json()
    message = got["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "Hi")
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert fake.submitted[-1][2].skip_special_tokens is False  # the markers reach the parser
    events = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in events[1:-1] if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi" and not any(d.get("reasoning") for d in deltas)
