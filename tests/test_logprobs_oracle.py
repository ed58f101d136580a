"""The logprob contract through the whole engine (real processes, tiny random checkpoints) against HF
transformers on the same weights, fp32: prompt logprobs (chunked prefill, after a prefix-cache fill),
sampled-token logprobs and ranks, processed logprobs for temperature/top-k/top-p, the kept mass that
turns one into the other, and trace replay against teacher forcing. Tolerance 1e-4."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
import torch

from tests.server_helpers import start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4
FLAGS = ("--block-size", "4", "--max-num-batched-tokens", "16", "--max-model-len", "256", "--enable-scale-out",
         "--enable-trace-replay", "--max-logprobs", "50")
FILTERS = [dict(temperature=1.0, top_k=12, top_p=0.9), dict(temperature=0.7, top_k=40, top_p=0.8),
           dict(temperature=1.3, top_p=0.95)]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Raw log-softmax [len, V]: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_processed(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """HF's own warpers, in vLLM's order (temperature, top-k, top-p), renormalised: [len, V] logprobs."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.log_softmax(x, -1)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j * j + 3) % vocab for j in range(n)] for i, n in enumerate((29, 9, 2))]


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrently(fn, items) -> list:
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i, x=x: out.__setitem__(i, fn(x))) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [out[i] for i in range(len(items))]


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch(request, tmp_path_factory, smollm2_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_with_tokenizer(request.param, tmp_path_factory.mktemp(request.param), smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf, hf.config.vocab_size


@pytest.fixture(scope="module")
def serve(arch, tmp_path_factory):
    """This arch's server for a --logprobs-mode, started on first use and shared by the arch's tests
    (raw_logprobs, the default, serves both the raw test and the raw half of the processed one)."""
    name, folder, _, _ = arch
    started: dict = {}

    def get(mode: str = "raw_logprobs"):
        if mode not in started:
            started[mode] = start_server(tmp_path_factory.mktemp(f"{name}-{mode}"), str(folder), *FLAGS,
                                         "--logprobs-mode", mode)
        return started[mode]

    yield get
    for s in started.values():
        s.stop()


def test_raw_prompt_and_sampled_logprobs_and_trace_replay(arch, serve):
    name, folder, hf, vocab = arch
    prompts = _prompts(vocab)
    s = serve()
    # fill the prefix cache with the first prompt: a prompt_logprobs request must not read it
    _post(s.url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 1})

    def completion(p):
        return _post(s.url, "/v1/completions", {
            "prompt": p, "echo": True, "logprobs": 3, "prompt_logprobs": 5, "max_tokens": 10,
            "temperature": 1.0, "seed": len(p), "ignore_eos": True, "return_tokens_as_token_ids": True,
            "return_token_ids": True})

    comps = _concurrently(completion, prompts)
    traces = [[(97 * i + 13 * j) % vocab for j in range(6)] for i in range(len(prompts))]

    def replay(args):
        p, trace = args
        return _post(s.url, "/inference/v1/generate", {"token_ids": p, "sampling_params": {
            "trace_decode_token_ids": trace, "logprobs": 2, "temperature": 0.8, "top_p": 0.5}})

    replays = _concurrently(replay, list(zip(prompts, traces)))
    worst = 0.0
    for p, comp, trace, rep in zip(prompts, comps, traces, replays):
        c = comp["choices"][0]
        out = c["token_ids"]
        assert comp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ref = hf_logprobs(hf, p + out)
        # prompt logprobs: None first, then every position, with HF's rank and top-5
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(p)
        for i in range(1, len(p)):
            entry = pl[i]
            mine = entry[str(p[i])]
            worst = max(worst, abs(mine["logprob"] - ref[i - 1, p[i]].item()))
            assert mine["rank"] == int((ref[i - 1] >= ref[i - 1, p[i]]).sum())
            assert {int(k) for k in entry} == {p[i], *ref[i - 1].topk(5).indices.tolist()}
            assert list(entry)[0] == str(p[i])  # the prompt token first, as vLLM's dict
        # echo: the prompt's logprobs, then the sampled tokens', in one list
        lp = c["logprobs"]
        assert _ids(lp["tokens"]) == p + out and lp["token_logprobs"][0] is None
        want = [ref[i - 1, t].item() for i, t in enumerate(p + out) if i > 0]
        worst = max(worst, max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)))
        # trace replay: forced tokens, teacher-forced logprobs and ranks (raw mode: unaffected by top_p)
        rc = rep["choices"][0]
        assert rc["token_ids"] == trace and rc["finish_reason"] == "length"
        tref = hf_logprobs(hf, p + trace)
        for k, (t, e) in enumerate(zip(trace, rc["logprobs"]["content"])):
            row = tref[len(p) - 1 + k]
            worst = max(worst, abs(e["logprob"] - row[t].item()))
            assert e["token_id"] == t and e["rank"] == int((row >= row[t]).sum())
            assert [x["token_id"] for x in e["top_logprobs"]][:1] == [t]
    assert worst < TOL, f"{name}: max |logprob - HF| = {worst:.2e}"
    print(f"{name}: max |logprob - HF| (prompt, sampled, trace) = {worst:.2e}")


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_processed_logprobs_and_kept_mass(arch, serve, mode):
    """processed server: logprobs == HF's warped distribution; raw server: raw - log(mass) == that same
    distribution (T = 1); both: log_softmax(logits / T) - log(mass) == processed."""
    name, folder, hf, vocab = arch
    p = _prompts(vocab)[0]
    s = serve(mode)
    bodies = _concurrently(lambda f: _post(s.url, "/v1/completions", {
        "prompt": p, "max_tokens": 12, "seed": 5, "ignore_eos": True, "logprobs": 4,
        "return_sampling_mass": True, "return_tokens_as_token_ids": True, "return_token_ids": True, **f}),
        FILTERS)
    worst = 0.0
    for f, body in zip(FILTERS, bodies):
        c = body["choices"][0]
        out, lps, mass = c["token_ids"], c["logprobs"]["token_logprobs"], c["sampling_mass"]
        logits = hf_logits(hf, p + out)[len(p) - 1:-1]
        proc = hf_processed(logits, **f)
        scaled = torch.log_softmax(logits / f["temperature"], -1)
        for k, t in enumerate(out):
            assert proc[k, t] > -math.inf, "sampled a token HF's warpers drop"
            if mode == "processed_logprobs":
                worst = max(worst, abs(lps[k] - proc[k, t].item()))
                worst = max(worst, abs(scaled[k, t].item() - math.log(mass[k]) - lps[k]))
                top = c["logprobs"]["top_logprobs"][k]
                kept = int((proc[k] > -math.inf).sum())
                want_top = proc[k].topk(4).values.tolist()
                got = sorted(top.values(), reverse=True)[:4]
                assert all(abs(max(a, -9999.0) - b) < TOL for a, b in zip(want_top, got) if kept >= 4)
            else:
                worst = max(worst, abs(lps[k] - torch.log_softmax(logits[k], -1)[t].item()))
                if f["temperature"] == 1.0:  # raw logprobs are the T = 1 distribution itself
                    worst = max(worst, abs(lps[k] - math.log(mass[k]) - proc[k, t].item()))
                worst = max(worst, abs(scaled[k, t].item() - math.log(mass[k]) - proc[k, t].item()))
    assert worst < TOL, f"{name} {mode}: max error {worst:.2e}"
    print(f"{name} {mode}: max |processed - HF| = {worst:.2e}")
