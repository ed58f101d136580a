"""Structured outputs end to end: guaranteed-valid JSON from SmolLM2 (real weights), forced tool calls from
a tiny random-weight Qwen3 with the real Qwen3 tokenizer (both through the `openai` SDK), the logprob
contract of the mask in the sampler, and bad input (400 naming the field, the engine keeps serving)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from bus.sampling_params import SamplingParams, StructuredOutputsParams
from gateway.forced_tools import ForcedToolStream, forced_tool_calls
from tests.fixtures_models import require_qwen3_tokenizer_dir, smollm2_dir  # noqa: F401
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from workers.grammar import GrammarEngine
from workers.sampler import RowState, sample

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 999},
                       "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
]
# small models ramble whitespace wherever JSON allows it, until max_tokens: vLLM's switch turns that off
NO_WHITESPACE = ("--structured-outputs-config", '{"disable_any_whitespace": true}')
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_dir):  # noqa: F811
    s = start_server(tmp_path_factory.mktemp("so"), str(smollm2_dir), "--max-model-len", "512", "--max-num-seqs", "32",
                     "--enable-scale-out", "--enable-trace-replay", *NO_WHITESPACE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tok = require_qwen3_tokenizer_dir()
    work = tmp_path_factory.mktemp("q3")
    folder = tiny_model_with_tokenizer("qwen3", work / "model", tok, vocab_size=151936, max_position_embeddings=2048)
    s = start_server(work, str(folder), "--max-model-len", "2048", "--max-num-seqs", "32", *NO_WHITESPACE)
    yield s
    s.stop()


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=900)


def _many(fn, n: int) -> list:
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(fn, range(n)))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 100 real-model requests: minutes on a busy 2-core host
def test_100_json_schema_responses_validate(smol):
    client = _client(smol)

    def one(i: int):
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": f"Person number {i}?"}],
            max_tokens=80, temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        return r.choices[0]

    for choice in _many(one, 100):
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_100_required_tool_calls_validate(qwen3):
    """One call per response (parallel_tool_calls false: vLLM's maxItems 1) except every tenth, where a random
    model may add items until max_tokens: those may end on "length", and then must still hold valid calls."""
    client = _client(qwen3)
    model = client.models.list().data[0].id

    def one(i: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Call a tool ({i})"}], tools=TOOLS,
            tool_choice="required", max_tokens=120, seed=i, parallel_tool_calls=i % 10 == 0).choices[0]

    for i, choice in enumerate(_many(one, 100)):
        if i % 10:
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1
        if choice.finish_reason == "length":
            continue  # an unfinished array of calls parses to none (as in vLLM)
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_and_streaming(qwen3):
    client = _client(qwen3)
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+2"}], tools=TOOLS,
                                       tool_choice=named, max_tokens=100, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's finish_reason for a named function
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["add"])
    for tool_choice in (named, "required"):
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}],
                                                tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=5,
                                                stream=True)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            c = chunk.choices[0]
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id:
                    assert d.index not in calls  # id, type and name come once, first
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments or ""
        assert calls and finish == ("stop" if tool_choice is named else "tool_calls")
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_constraints_of_every_kind(smol):
    url = smol.url + "/v1/completions"
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_regex": "[0-9]{3}-[a-z]{2,5}"}, lambda t: len(t.split("-")[0]) == 3 and t[3] == "-"),
             ({"structured_outputs": {"grammar": 'start: "hi" | "ho"'}}, lambda t: t in ("hi", "ho")),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict))]
    for body, ok in cases:
        r = httpx.post(url, json={"prompt": "Answer:", "max_tokens": 60, "seed": 1, **body}, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert ok(text), (body, text)
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(smol.url + "/inference/v1/generate", json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 10, "structured_outputs": {"choice": ["yes"]}}},
        timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "a"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"json": {"type": "object"}}}, "guided_json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(smol, body, param):
    r = httpx.post(smol.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(smol.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the engine keeps serving


# --- the worker's parts, in-process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_dir):  # noqa: F811
    return GrammarEngine(Path(smollm2_dir) / "tokenizer.json", 49152)


def _row(engine, so, **params):
    p = SamplingParams(structured_outputs=so, **params)
    return RowState(p, [2], [1], [], None, engine.start(so, [2]))


def test_logprob_contract_raw_ignores_the_mask_processed_and_mass_include_it(engine):
    so = StructuredOutputsParams(choice=["yes", "no"])
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0))
    rows = [_row(engine, so, temperature=0.0, logprobs=5, return_sampling_mass=True)]
    masks = engine.fill([0], [rows[0].grammar])
    raw = sample(logits, rows, torch.Generator(), "raw_logprobs", masks)
    proc = sample(logits, rows, torch.Generator(), "processed_logprobs", masks)
    bits = np.unpackbits(masks.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[0, :49152]
    allowed = torch.from_numpy(bits.nonzero()[0])
    assert 1 < len(allowed) < 100  # the first tokens of "yes" and "no"
    tok = int(raw.token_ids[0])
    assert tok in allowed.tolist()
    full = torch.log_softmax(logits, -1)[0]
    assert raw.logprobs[0] == pytest.approx(float(full[tok]))  # raw: the model's own distribution
    kept = float(torch.logsumexp(full[allowed], 0).exp())
    assert float(raw.sampling_mass[0]) == pytest.approx(kept, rel=1e-4)  # mass: what the mask kept
    assert proc.logprobs[0] == pytest.approx(float(full[tok]) - float(torch.log(torch.tensor(kept))), abs=1e-4)


def test_rejected_forced_token_is_a_per_sequence_error(engine):
    so = StructuredOutputsParams(regex="[0-9]+")
    row = _row(engine, so)
    engine.live.add("s")
    letter = engine._tok.tokenize_str("abc")[0]
    engine.advance(["s"], [row], [letter])
    ((sid, err),) = engine.take_errors()
    assert sid == "s" and err.kind == "GrammarRejected" and err.param == "trace_decode_token_ids"
    engine.live.discard("s")


def test_mask_cost_for_a_batch_of_64(engine):
    """fill + apply for 64 constrained rows (SmolLM2's 49k vocabulary) stays under 1 ms per row even on a busy
    host (best of 5; about 0.1-0.5 ms per row measured here under load)."""
    import time

    so = StructuredOutputsParams(json=json.dumps(PERSON))
    rows = [_row(engine, so) for _ in range(64)]
    for r in rows:  # into a string value, where most of the vocabulary is allowed
        r.grammar.matcher.consume_tokens(engine._tok.tokenize_str('{"name": "a'))
    logits = torch.randn(64, 49152)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        masks = engine.fill(list(range(64)), [r.grammar for r in rows])
        from workers.grammar import apply_masks

        apply_masks(logits.clone(), masks)
        best = min(best, time.perf_counter() - t0)
    assert best / 64 < 1e-3, f"{best * 1e3:.2f} ms for 64 rows"


def test_masks_filled_while_the_model_runs_are_those_of_the_step_they_were_started_for(engine):
    """step_masks fills on the grammar thread (the runner starts it before the forward pass); its masks are
    the ones the matchers' state called for when it started, even when `advance` comes right after (it
    waits for the fill), and they equal a fill done in the caller's thread."""
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    rows = [_row(engine, so) for _ in range(64)]
    twins = [engine.start(so, [2]) for _ in range(64)]
    prefix = engine._tok.tokenize_str('{"name":"Bo')
    for r, t in zip(rows, twins):
        r.grammar.matcher.consume_tokens(prefix)
        t.matcher.consume_tokens(prefix)
    ids = [f"s{i}" for i in range(64)]
    engine.live.update(ids)
    try:
        pending = engine.step_masks(rows)
        engine.advance(ids, rows, engine._tok.tokenize_str("b")[:1] * 64)  # moves every matcher on
        assert not engine.take_errors()
        masks = pending.result()
    finally:
        engine.live.difference_update(ids)
    same = engine.fill(list(range(64)), twins)
    assert masks.rows == same.rows == list(range(64))
    assert torch.equal(masks.bitmask, same.bitmask)
    moved = engine.fill(list(range(64)), [r.grammar for r in rows])
    assert not torch.equal(moved.bitmask, same.bitmask)  # the advance did move them: a later state's masks


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_a_masked_row_samples_the_same_bits_alone_and_in_any_batch(engine, mode):
    """A seeded constrained row's token, logprob and mass do not depend on its batch: alone, among masked rows
    only (the sampler's one-softmax path) or among plain and masked rows (its partial path)."""
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    prefix = engine._tokenizer().tokenize_str('{"name":"Bo')

    def row(i, constrained=True):
        p = SamplingParams(temperature=1.0, seed=i, logprobs=2, return_sampling_mass=True,
                           structured_outputs=so if constrained else None)
        g = engine.start(so, [2]) if constrained else None
        if g is not None:
            g.matcher.consume_tokens(prefix)
        return RowState(p, [2], [1], [], torch.Generator().manual_seed(i), g)

    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(1)) * 4

    def first(rows, at):
        idx = [i for i, r in enumerate(rows) if r.grammar is not None]
        out = sample(logits[at], rows, torch.Generator().manual_seed(0), mode,
                     engine.fill(idx, [rows[i].grammar for i in idx]))
        return (int(out.token_ids[0]), out.logprobs[0].item(), out.topk_logprobs[0].tolist(),
                out.sampling_mass[0].item())

    alone = first([row(0)], [0])
    assert first([row(0)] + [row(i) for i in range(1, 16)], list(range(16))) == alone
    assert first([row(0)] + [row(i, constrained=i % 2 == 0) for i in range(1, 16)], list(range(16))) == alone


def test_forced_stream_reassembles_to_the_whole_result():
    text = '[{"name": "add", "parameters": {"a": 1, "b": {"x": "}],"}}}, {"name": "get_weather", "parameters": {}}]'
    for step in (1, 3, 7):
        f = ForcedToolStream("required")
        calls: dict[int, dict] = {}
        for k in range(0, len(text), step):
            for d in f.push(text[k:k + step]):
                if "id" in d:
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
                else:
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
        whole = forced_tool_calls("required", text)
        assert [c["name"] for c in calls.values()] == [c["function"]["name"] for c in whole]
        assert [json.loads(c["arguments"]) for c in calls.values()] == \
               [json.loads(c["function"]["arguments"]) for c in whole]


def test_bus_admission_checks_the_constraint():
    """A peer that bypasses the gateway gets the same 400s from the scheduler's admission."""
    from bus.messages import AddRequest
    from engine.scheduler.admission import EngineLimits, admission_error

    limits = EngineLimits(vocab_size=1000, max_model_len=64)

    def err(so):
        return admission_error(AddRequest("r", [1, 2], SamplingParams(max_tokens=4, structured_outputs=so), [2], 0.0),
                               limits)

    assert err(StructuredOutputsParams(regex="[0-9]+")) is None
    bad = err(StructuredOutputsParams(regex="(a"))
    assert bad.status == 400 and bad.param == "sampling.structured_outputs.regex"
    both = err(StructuredOutputsParams(regex="a", choice=["b"]))
    assert both.status == 400 and both.param == "sampling.structured_outputs"
    assert err(StructuredOutputsParams(choice=[])).param == "sampling.structured_outputs.choice"


def test_trace_token_the_grammar_rejects_fails_that_request_only(smol):
    tok = httpx.post(smol.url + "/tokenize", json={"prompt": "abc"}, timeout=30).json()["tokens"]
    gen = smol.url + "/inference/v1/generate"
    bad = httpx.post(gen, json={"token_ids": [1, 2, 3], "sampling_params": {
        "max_tokens": 5, "trace_decode_token_ids": tok, "structured_outputs": {"regex": "[0-9]+"}}}, timeout=60)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "trace_decode_token_ids"
    ok = httpx.post(gen, json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}, timeout=60)
    assert ok.status_code == 200


def test_a_finished_grammar_allows_only_the_requests_eos(engine):
    """The grammar's end allows the request's EOS ids, not the tokenizer's guess (a bug: a tokenizer EOS the
    scheduler did not stop on ended the constraint, and the output ran on unconstrained)."""
    so = StructuredOutputsParams(choice=["yes"])
    g = engine.start(so, [2])
    assert engine.eos_token != 2  # SmolLM2: llguidance guesses id 0
    g.matcher.consume_tokens(engine._tok.tokenize_str("yes"))
    bits = np.unpackbits(engine.fill([0], [g]).bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[0]
    assert bits[:49152].nonzero()[0].tolist() == [2]
    assert g.accept(2, engine.eos_token) and g.terminated


def test_a_recompute_after_preemption_advances_the_matcher_once(tmp_path, smollm2_dir):  # noqa: F811
    """ModelRunner driven by hand-written plans: a recompute from position 0 (preemption) re-runs known tokens
    and samples one new token, so "[0-9]{6}" still gets exactly six digits and then EOS."""
    from bus.messages import NewSeq, StepPlan
    from tests.tiny_models import load_model
    from workers.kv_cache import KVCache
    from workers.model_runner import ModelRunner

    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "q", Path(smollm2_dir), vocab_size=49152)
    model = load_model(folder)
    kv = KVCache(*model.kv_spec, 4, 16, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, rank=0, block_size=4, device=torch.device("cpu"),
                         tokenizer_path=folder / "tokenizer.json")
    sp = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}"))
    table = [[1, 2, 3, 4]]
    out: list[int] = []

    def step(k, new, computed, n):
        res = runner.execute(StepPlan(k, new, ["s"], [computed], [n], table, [], 0))
        assert not res.seq_errors
        out.append(int(res.token_ids[0]))

    step(1, [NewSeq("s", [1, 2, 3], sp, [2])], 0, 3)
    step(2, [], 3, 1)
    step(3, [], 4, 1)
    step(4, [], 0, 6)  # preempted and recomputed: prompt + 3 outputs again
    for k, computed in enumerate((6, 7, 8), start=5):
        step(k, [], computed, 1)
    text = runner.grammar._tok.decode_str(out[:6])
    assert len(text) == 6 and text.isdigit(), (out, text)
    assert out[6] == 2  # the grammar is complete: EOS only
