"""Routed experts (--enable-return-routed-experts) through the real engine: the base64 `.npy` each choice
returns equals HF transformers' router top-k (output_router_logits, top-k of the softmaxed router logits)
at every MoE layer and every position of prompt + generated tokens (teacher-forced over
prompt + output[:-1]), through chunked prefills, a preemption with recompute and prefix-cache hits; on
completions, chat and generate, streamed or not; routed_experts_prompt_start; bad input; null when off or
dense. Then the runner alone (uint16 ids, the per-slot copy behind prefix hits, rank > 0) and the piece
arithmetic; last, the SmolLM2 MoE on English text (slow)."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import pytest
import torch

from bus.messages import NewSeq, StepPlan
from bus.sampling_params import SamplingParams
from engine import routed_experts as rx
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.test_moe_oracle import MIN_MARGIN, SENTENCE, hf_reference
from tests.tiny_models import load_model, make_tiny_checkpoint
from workers.kv_cache import KVCache
from workers.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

SMOL_VOCAB = 49152  # SmolLM2's tokenizer: the tiny checkpoints get its vocabulary so text prompts are valid
FIELD = "routed_experts_prompt_start"


def decode(value: str) -> np.ndarray:
    """What a client does: base64 -> .npy -> array (no pickle)."""
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def hf_routes(hf, ids: list[int], top_k: int) -> np.ndarray:
    """HF's top-k experts [len(ids), moe_layers, k]; refuses a near-tie that would make the check noise."""
    _, routes, margin = hf_reference(hf, ids, top_k)
    assert margin > MIN_MARGIN, f"near-tie in HF's router (gap {margin:.2e}); pick other prompts"
    return routes.numpy()


def check_routes(hf, value: str | None, prompt: list[int], output: list[int], top_k: int, start: int = 0,
                 dtype=np.uint8) -> np.ndarray:
    assert value is not None, "routed_experts is null"
    got = decode(value)
    n = len(prompt) + len(output) - 1
    assert got.dtype == dtype and got.shape == (n - start, hf_layers(hf), top_k), (got.dtype, got.shape)
    want = hf_routes(hf, prompt + output[:-1], top_k)[start:]
    bad = np.argwhere((got != want).any(axis=(1, 2)))
    assert not len(bad), f"positions {(bad[:5, 0] + start).tolist()} differ from HF"
    return got


def hf_layers(hf) -> int:
    return sum(1 for layer in hf.model.layers if hasattr(layer.mlp, "experts"))


def prompt_ids(i: int, n: int, vocab: int = 1500) -> list[int]:
    return [(37 * i + 11 * j * j + 5) % vocab + 3 for j in range(n)]


# ------------------------------------------------------------------------- a tiny Qwen3-MoE served


@pytest.fixture(scope="module")
def moe(tmp_path_factory, smollm2_dir):
    """Qwen3-MoE (3 layers, the middle one dense; 8 experts, top-2) with SmolLM2's tokenizer, served with
    4-token blocks, a 16-token step budget (prefills are chunked) and 24 KV blocks (96 tokens: four
    concurrent requests cannot all fit, so some are preempted and recomputed)."""
    folder = tiny_model_with_tokenizer("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), smollm2_dir,
                                       vocab_size=SMOL_VOCAB)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = start_server(tmp_path_factory.mktemp("serve"), str(folder), "--enable-return-routed-experts",
                     "--enable-scale-out", "--block-size", "4", "--max-num-batched-tokens", "16",
                     "--num-gpu-blocks-override", "24", "--max-model-len", "96")
    yield s, str(folder), hf
    s.stop()


def complete(s, model: str, prompt, **kw) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "return_token_ids": True, **kw}
    r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_routes_match_hf_through_chunks_preemption_and_prefix_hits(moe):
    s, model, hf = moe
    prompts = [prompt_ids(i, n) for i, n in enumerate((9, 33, 21, 27))]
    got: dict[int, dict] = {}

    def go(i):
        got[i] = complete(s, model, prompts[i], max_tokens=36, seed=i)

    preempted = metric(s, "vllm:num_preemptions_total")
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert metric(s, "vllm:num_preemptions_total") > preempted, "the fixture should force a recompute"
    for i, p in enumerate(prompts):
        c = got[i]["choices"][0]
        assert c["prompt_token_ids"] == p and len(c["token_ids"]) == 36
        check_routes(hf, c["routed_experts"], p, c["token_ids"], 2)
    # The same prompt again starts from the prefix cache: the positions it skips still have their routes.
    p = prompt_ids(7, 26)
    first = complete(s, model, p)
    again = complete(s, model, p, seed=5)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 24
    for body in (first, again):
        c = body["choices"][0]
        check_routes(hf, c["routed_experts"], p, c["token_ids"], 2)


def test_prompt_start_skips_a_prefix(moe):
    s, model, hf = moe
    p = prompt_ids(3, 20)
    full = complete(s, model, p, temperature=0)["choices"][0]
    all_rows = check_routes(hf, full["routed_experts"], p, full["token_ids"], 2)
    for start in (1, 13, len(p)):
        c = complete(s, model, p, temperature=0, routed_experts_prompt_start=start)["choices"][0]
        assert c["token_ids"] == full["token_ids"]
        assert np.array_equal(decode(c["routed_experts"]), all_rows[start:])
    assert decode(c["routed_experts"]).shape == (11, 2, 2)  # start = prompt length: the outputs but the last


def test_streams_carry_routes_on_the_last_chunk_only(moe):
    s, model, hf = moe
    p = prompt_ids(4, 15)
    with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True, "return_token_ids": True, FIELD: 2}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    toks: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for ch in chunks:
        c = ch["choices"][0]
        toks[c["index"]] += c["token_ids"]
        if c["finish_reason"] is None:
            assert "routed_experts" not in c
        else:
            finals[c["index"]] = c["routed_experts"]
    assert set(finals) == {0, 1}
    for i in (0, 1):
        check_routes(hf, finals[i], p, toks[i], 2, start=2)


def test_chat_and_generate(moe, smollm2_dir):
    s, model, hf = moe
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    for stream in (False, True):
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            prompt = events[0]["prompt_token_ids"]
            out = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
            value = [c["routed_experts"] for e in events for c in e["choices"] if c["finish_reason"]][0]
        else:
            body = r.json()
            prompt, out = body["prompt_token_ids"], body["choices"][0]["token_ids"]
            value = body["choices"][0]["routed_experts"]
        assert max(prompt) > 1500, "a real chat prompt, through SmolLM2's tokenizer"
        check_routes(hf, value, prompt, out, 2)
    p = prompt_ids(5, 17)
    for stream in (False, True):
        r = httpx.post(s.url + "/inference/v1/generate", timeout=120, json={
            "token_ids": p, "stream": stream,
            "sampling_params": {"max_tokens": 7, "seed": 3, "ignore_eos": True, FIELD: 4}})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            out = [t for e in events for t in e["choices"][0]["token_ids"]]
            values = [e["choices"][0]["routed_experts"] for e in events]
            assert all(v is None for v in values[:-1])
            value = values[-1]
        else:
            c = r.json()["choices"][0]
            out, value = c["token_ids"], c["routed_experts"]
        check_routes(hf, value, p, out, 2, start=4)


def test_bad_prompt_start_is_a_400_naming_the_field(moe):
    s, model, _ = moe
    p = prompt_ids(6, 8)
    chat = [{"role": "user", "content": "hi"}]
    for bad in (-1, 9, 10_000, "3", 1.5, True, [1]):
        for path, body, param in (
                ("/v1/completions", {"prompt": p, FIELD: bad}, FIELD),
                ("/v1/chat/completions", {"messages": chat, FIELD: bad}, FIELD),
                ("/inference/v1/generate", {"token_ids": p, "sampling_params": {FIELD: bad}},
                 f"sampling_params.{FIELD}")):
            if bad == 9 and "chat" in path:
                continue  # the rendered chat is longer than 9 tokens
            r = httpx.post(s.url + path, json={"max_tokens": 2, **body}, timeout=60)
            assert r.status_code == 400, (path, bad, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "BadRequestError", (path, bad, err)
            if isinstance(bad, int) and not isinstance(bad, bool) and path != "/v1/chat/completions":
                assert "[0, 8]" in err["message"], err["message"]
    # the engine keeps serving; an explicit null means 0
    c = complete(s, model, p, max_tokens=3, **{FIELD: None})["choices"][0]
    assert decode(c["routed_experts"]).shape == (10, 2, 2)


# ------------------------------------------------------------------------- other servers


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, smollm2_dir):
    folder = tiny_model_with_tokenizer("mixtral", tmp_path_factory.mktemp("mixtral"), smollm2_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = start_server(tmp_path_factory.mktemp("serve"), str(folder), "--enable-return-routed-experts",
                     "--block-size", "4", "--max-num-batched-tokens", "8", "--max-model-len", "128")
    yield s, str(folder), hf
    s.stop()


def test_mixtral_routes_match_hf(mixtral):
    s, model, hf = mixtral
    for i, n in enumerate((5, 19)):
        p = prompt_ids(i, n, 1000)
        c = complete(s, model, p, n=2, seed=9)["choices"]
        for choice in c:
            check_routes(hf, choice["routed_experts"], p, choice["token_ids"], 2)


def test_null_without_the_flag_and_for_dense_models(tmp_path, smollm2_dir):
    moe_dir = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    dense_dir = make_tiny_checkpoint("qwen3", tmp_path / "dense")
    for folder, flags in ((moe_dir, ["--tokens-only"]),
                          (dense_dir, ["--tokens-only", "--enable-return-routed-experts"])):
        s = start_server(tmp_path, str(folder), *flags, "--max-model-len", "128")
        try:
            body = complete(s, str(folder), prompt_ids(1, 6), max_tokens=3, **{FIELD: 2})
            assert body["choices"][0]["routed_experts"] is None
            r = httpx.post(s.url + "/inference/v1/generate", timeout=60,
                           json={"token_ids": [4, 5, 6], "sampling_params": {"max_tokens": 2}})
            assert r.status_code == 200 and r.json()["choices"][0]["routed_experts"] is None
        finally:
            s.stop()


# ------------------------------------------------------------------------- the runner alone

BS = 4


def _runner(model, rank=0, capture=True, blocks=32):
    kv = KVCache(*model.kv_spec, BS, blocks, torch.float32, torch.device("cpu"))
    return ModelRunner(model, kv, rank=rank, block_size=BS, device=torch.device("cpu"),
                       return_routed_experts=capture)


def _plan(step, new, ids, computed, new_n, tables):
    return StepPlan(step, new, ids, computed, new_n, tables, [], 0)


def _pieces(res) -> dict[str, list]:
    out: dict[str, list] = {}
    for sid, start, first, n in res.routed_spans:
        out.setdefault(sid, []).append((start, res.routed_experts[first:first + n]))
    return out


def test_runner_uint16_prefix_hit_and_recompute(tmp_path):
    """300 experts: ids travel as uint16. A sequence that starts after a prefix-cache hit (blocks another
    sequence computed) gets the skipped positions from the per-slot copy; a recompute sends positions
    again. Everything equals HF."""
    folder = make_tiny_checkpoint("qwen3_moe", tmp_path / "wide", num_experts=300, num_experts_per_tok=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder)
    r = _runner(model)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = prompt_ids(2, 14)
    a = r.execute(_plan(1, [NewSeq("a", prompt, sp, [])], ["a"], [0], [14], [[0, 1, 2, 3]]))
    assert a.routed_experts.dtype == np.uint16 and a.routed_spans == [["a", 0, 0, 14]]
    # b shares a's first 3 blocks (12 positions) and computes the rest in its own block 4
    b = r.execute(_plan(2, [NewSeq("b", prompt, sp, [])], ["b"], [12], [2], [[0, 1, 2, 4]]))
    assert b.routed_spans == [["b", 0, 2, 12], ["b", 12, 0, 2]]
    got = rx.assemble(_pieces(b)["b"], 0, 14)
    want = hf_routes(hf, prompt, 3)
    assert np.array_equal(got, want) and got.max() > 255
    # a decodes one token, then is preempted and recomputed from 0 in one chunk
    tok = int(a.token_ids[0])
    d = r.execute(_plan(3, [], ["a"], [14], [1], [[0, 1, 2, 3]]))
    rc = r.execute(_plan(4, [], ["a"], [0], [16], [[5, 6, 7, 8]]))
    pieces = [(0, a.routed_experts), *_pieces(d)["a"], *_pieces(rc)["a"]]
    assert [p[0] for p in pieces] == [0, 14, 0]
    whole = rx.assemble(pieces, 0, 16)
    assert np.array_equal(whole, hf_routes(hf, prompt + [tok, int(d.token_ids[0])], 3))


def test_runner_captures_nothing_when_off_dense_or_not_rank_0(tmp_path):
    moe = load_model(make_tiny_checkpoint("qwen3_moe", tmp_path / "moe"))
    dense = load_model(make_tiny_checkpoint("qwen3", tmp_path / "dense"))
    sp = SamplingParams(temperature=0.0)
    for model, rank, capture in ((moe, 0, False), (dense, 0, True), (moe, 1, True)):
        r = _runner(model, rank, capture)
        assert r.route_dtype is None
        res = r.execute(_plan(1, [NewSeq("a", [5, 6, 7], sp, [])], ["a"], [0], [3], [[0]]))
        assert res.routed_experts is None and res.routed_spans is None
    res = _runner(moe).execute(_plan(1, [NewSeq("a", [5, 6, 7], sp, [])], ["a"], [0], [2], [[0]]))
    assert res.seq_ids == [] and res.routed_experts.shape == (2, 2, 2)  # a partial chunk has routes too


def test_pieces():
    a = np.arange(12, dtype=np.uint8).reshape(6, 1, 2)
    assert rx.merge([]) is None and rx.merge([(3, a)])[1] is a
    # in order: one concatenate; lo/hi cut
    s, m = rx.merge([(0, a[:2]), (2, a[2:5]), (5, a[5:])])
    assert s == 0 and np.array_equal(m, a)
    assert np.array_equal(rx.assemble([(0, a[:2]), (2, a[2:])], 1, 4), a[1:4])
    # a recompute: later pieces replace earlier positions; nothing counted twice
    redo = a + 100
    s, m = rx.merge([(0, a), (0, redo[:3])])
    assert s == 0 and np.array_equal(m, np.concatenate([redo[:3], a[3:]]))
    assert rx.assemble([(0, a)], 6, 6).shape == (0, 1, 2)
    assert rx.wire_dtype(256) == np.uint8 and rx.wire_dtype(257) == np.uint16
    assert np.array_equal(rx.from_b64(rx.to_b64(a)), a)


# ------------------------------------------------------------------------- SmolLM2 MoE, English


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run in a cache builds the folder
def test_upcycled_smollm2_routes_through_the_server(tmp_path, smollm2_moe_dir):
    """Real English text through /v1/completions: 30 MoE layers x 4 experts, every position of prompt and
    output equal to HF's router top-2."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_moe_dir, dtype=torch.float32).eval()
    s = start_server(tmp_path, str(smollm2_moe_dir), "--enable-return-routed-experts", "--max-model-len", "256",
                     "--max-num-batched-tokens", "32")
    try:
        body = complete(s, str(smollm2_moe_dir), SENTENCE, max_tokens=8, temperature=0)
    finally:
        s.stop()
    c = body["choices"][0]
    got = check_routes(hf, c["routed_experts"], c["prompt_token_ids"], c["token_ids"], 2)
    assert got.shape[1] == 30 and np.bincount(got.ravel(), minlength=4).min() > 0
