"""Tensor parallelism (-tp N) with real processes over CPU Gloo: a tp engine computes what a -tp 1 engine
does (greedy tokens identical, logprobs within 1e-5 in fp32), each worker holds its share of the weights
and the KV cache (as the workers measure it), and every RL path works on sharded workers: weight updates
over both backends with a per-shard /weight_checker, sleep/wake, pauses, prompt logprobs, routed experts,
trace replay. Servers are shared per class (started once, stopped before the next class starts: the
machine has 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.config import parse_config
from engine.trainer.client import WeightSyncClient
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from workers.models.checkpoint import iter_safetensors, load_hf_config
from workers.models.registry import shard_checksums
from workers.models.tp_layout import layout_error

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parent.parent
RL = '{"rl_config": {"enabled": true}}'
PROMPTS = [[5, 17, 99, 250, 31, 8, 77], [3, 1, 4, 1, 5, 9, 2, 6, 11, 400]]
LP_TOL = 1e-5
SMOL_LP_TOL = 1e-4  # SmolLM2's fp32 noise floor: see TestSmolLM2


def serve(tmp, folder, tp: int, backend: str, *extra: str):
    return start_server(tmp, str(folder), "-tp", str(tp), "--additional-config", RL, "--enable-scale-out",
                        "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": 30}),
                        "--max-model-len", "128", "--block-size", "4", "--num-gpu-blocks-override", "96",
                        "--master-port", str(_free_port()), *extra, timeout_s=400)


def _free_port() -> int:
    from tests.serve_process import free_port

    return free_port()


def generate(url: str, prompt: list[int], headers: dict[str, str] | None = None, **sampling) -> dict:
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3, **sampling}
    r = httpx.post(url + "/inference/v1/generate", timeout=120, headers=headers,
                   json={"token_ids": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def tokens_and_logprobs(out: dict) -> tuple[list[int], list[float], list[list[float]]]:
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    return choice["token_ids"], [c["logprob"] for c in content], [[t["logprob"] for t in c["top_logprobs"]]
                                                                  for c in content]


def assert_same_generation(ref: dict, got: dict, tol: float = LP_TOL) -> None:
    """Greedy tokens identical, every logprob (sampled and top-k) within `tol`."""
    ids_a, lp_a, top_a = tokens_and_logprobs(ref)
    ids_b, lp_b, top_b = tokens_and_logprobs(got)
    assert ids_a == ids_b
    assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < tol
    assert max(abs(a - b) for ra, rb in zip(top_a, top_b) for a, b in zip(ra, rb)) < tol


def _wait_running(server) -> None:
    """Until the server has a request in a running batch (or 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(server, "vllm:num_requests_running") < 1:
        time.sleep(0.05)


def workers_info(url: str) -> dict[str, dict]:
    return httpx.get(url + "/server_info", timeout=30).json()["workers"]


def checksums(url: str) -> dict[str, str]:
    r = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


def compare(url: str, baseline: dict[str, str]) -> dict:
    return httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=120).json()


def perturbed(folder: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (HF names), every one moved: a trainer's next version."""
    g = torch.Generator().manual_seed(seed)
    return [(n, t + torch.randn(t.shape, generator=g) * 0.05) for n, t in iter_safetensors(folder)]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, smollm2_dir) -> Path:
    return tiny_model_with_tokenizer("qwen3_moe", tmp_path_factory.mktemp("tp") / "qwen3_moe", smollm2_dir)


# ------------------------------------------------------------------------- layout and flags (no servers)


def test_layout_errors_name_the_value():
    smol = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert layout_error(smol, 1) is None and layout_error(smol, 3) is None
    assert "--tensor-parallel-size 2 does not divide the model's 9 attention heads" in layout_error(smol, 2)
    gqa = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64}
    assert layout_error(gqa, 4) is None and layout_error(gqa, 8) is None  # KV heads replicated 2x, 4x
    assert "6 KV heads" in layout_error({"num_attention_heads": 12, "num_key_value_heads": 6}, 4)
    assert "intermediate_size 100" in layout_error({"num_attention_heads": 8, "intermediate_size": 100}, 8)
    assert "moe_intermediate_size 30" in layout_error({"num_attention_heads": 4, "moe_intermediate_size": 30}, 4)
    shared = {"num_attention_heads": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 30}
    assert "shared_expert_intermediate_size 30" in layout_error(shared, 4)
    olmo = {"architectures": ["Olmo2ForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2}
    assert layout_error(olmo, 2) is None and "each rank must hold distinct KV heads" in layout_error(olmo, 4)


def test_tp_flags_parse_and_bad_values_are_refused():
    cfg = parse_config(["-tp", "2", "--master-port", "30001"])
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.master_port,
            cfg.parallel.workers_per_engine) == (2, 30001, 2)
    assert cfg.to_argv() == ["--tensor-parallel-size", "2", "--master-port", "30001"]  # what children get
    for argv, text in ((["-tp", "2", "--num-workers", "2"], "--num-workers 2: removed"),
                       (["-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
                       (["-tp", "2", "--master-port", "0"], "--master-port must be a port number")):
        with pytest.raises(SystemExit, match=text):
            parse_config(argv)


def test_a_tp_that_does_not_divide_the_heads_stops_start_up_naming_it(tmp_path, moe_folder):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", str(moe_folder), "-tp", "3",
                        "--bus-dir", str(tmp_path / "bus")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in r.stderr


# ------------------------------------------------------------- the sharded model itself, 4 ranks


def _steps(model) -> list[torch.Tensor]:
    from tests.tiny_models import PagedRunner

    runner = PagedRunner(model)
    return [runner.step(prefills=[(0, PROMPTS[0]), (1, PROMPTS[1])]), runner.step(decodes=[(0, 11), (1, 12)])]


def _run_ranks(target, size: int, *args):
    """`target(rank, *args, port, queue)` in `size` spawned processes (one tp group on a free port); returns
    what rank 0 put on the queue, after every rank exited cleanly."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, q)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = q.get(timeout=240)
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    return got


def _rank_logits(rank: int, size: int, folder: str, port: int, q) -> None:
    """One tp rank: build its shard, load it from the HF tensors, run a prefill and a decode step; then load
    it again from a -tp 1 model's own (fused) tensors and run them again; rank 0 sends the logits home."""
    torch.set_num_threads(1)
    from ascend_ops.tp_group import init_tp_group
    from workers.models.registry import build_model

    tp = init_tp_group(rank, size, torch.device("cpu"), port=port, timeout_s=120)
    model = build_model(load_hf_config(folder), torch.float32, "cpu", tp=tp)
    model.load_weights(iter_safetensors(folder))
    from_hf = _steps(model)
    full = build_model(load_hf_config(folder), torch.float32, "cpu")
    full.load_weights(iter_safetensors(folder))
    for p in model.parameters():
        p.data.zero_()
    model.load_weights((n, p.data) for n, p in full.named_parameters())
    from_fused = _steps(model)
    if rank == 0:  # as numpy, pickled by value: a torch tensor would travel as a handle to this process's
        # memory, which the parent can no longer open once this process has exited (connection reset)
        q.put(tuple([t.detach().numpy() for t in run] for run in (from_hf, from_fused)))
    tp.destroy()


def test_four_ranks_with_replicated_kv_heads_and_a_padded_vocabulary_match_one(tmp_path):
    """Llama with 4 heads, 2 KV heads (each on 2 of the 4 ranks), biases, untied LM head and a vocabulary of
    1001 (ranks of 251 rows, the last with 2 padding rows): -tp 4's logits are -tp 1's, loaded from HF
    names or from our fused ones."""
    from tests.tiny_models import make_tiny_checkpoint
    from workers.models.registry import build_model

    folder = make_tiny_checkpoint("llama", tmp_path / "llama", vocab_size=1001)
    one = build_model(load_hf_config(folder), torch.float32, "cpu")
    one.load_weights(iter_safetensors(folder))
    want = _steps(one)
    got = _run_ranks(_rank_logits, 4, 4, str(folder))
    for run in got:
        for a, b in zip(want, map(torch.from_numpy, run)):
            assert a.shape == b.shape == (a.shape[0], 1001)
            assert torch.equal(a.argmax(-1), b.argmax(-1)) and (a - b).abs().max() < 1e-4


def runner_steps(model, rank: int, span_bytes: int, head_bytes: int | None = None) -> tuple[list[tuple], list[int]]:
    """40 sequences (greedy with top-2 logprobs, and seeded draws) through a ModelRunner: a prefill step and
    two decodes; the sampler's spans set by `span_bytes`, the LM head's products by `head_bytes` (None: as
    configured). Rank 0's tokens, logprobs and top-2 per step, and the rows of every LM head product."""
    import workers.sampler as sampler

    kept = sampler.SPAN_BYTES, sampler.HEAD_BYTES
    sampler.SPAN_BYTES, sampler.HEAD_BYTES = span_bytes, head_bytes or sampler.HEAD_BYTES
    product, products = model.lm_head_product, []
    model.lm_head_product = lambda hidden: products.append(len(hidden)) or product(hidden)
    try:
        return _runner_steps(model, rank), products
    finally:
        sampler.SPAN_BYTES, sampler.HEAD_BYTES = kept
        del model.lm_head_product


def _runner_steps(model, rank: int) -> list[tuple]:
    from bus.messages import NewSeq, StepPlan
    from bus.sampling_params import SamplingParams
    from workers.kv_cache import KVCache
    from workers.model_runner import ModelRunner

    nl, nkv, hd = model.kv_spec
    runner = ModelRunner(model, KVCache(nl, nkv, hd, 4, 3 * 40 + 1, torch.float32, torch.device("cpu")),
                         rank=rank, block_size=4, device=torch.device("cpu"))
    ids = [f"s{i}" for i in range(40)]
    params = [SamplingParams(temperature=0.0, logprobs=2, max_tokens=8) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=8) for i in range(40)]
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(5 + i % 3)] for i in range(40)]
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(40)]
    out = []
    for step in range(3):
        new = [NewSeq(s, p, sp, [0]) for s, p, sp in zip(ids, prompts, params)] if step == 0 else []
        computed = [0] * 40 if step == 0 else [len(p) + step - 1 for p in prompts]
        res = runner.execute(StepPlan(step + 1, new, ids, computed, [len(p) for p in prompts] if step == 0 else
                                      [1] * 40, tables, [], 0))
        out.append((res.token_ids.tolist(), res.logprobs.tolist(), res.topk_logprobs.tolist()))
    return out


def _rank_sampling(rank: int, folder: str, port: int, q) -> None:
    torch.set_num_threads(1)
    from ascend_ops.tp_group import init_tp_group
    from workers.models.registry import build_model

    tp = init_tp_group(rank, 2, torch.device("cpu"), port=port, timeout_s=120)
    model = build_model(load_hf_config(folder), torch.float32, "cpu", tp=tp)
    model.load_weights(iter_safetensors(folder))
    # spans of 16 rows, LM head products of at most 32 (fp32 gathered): 2 gathers of 20 rows a step, the
    # second of 3 spans straddling them
    got = runner_steps(model, rank, 16 * 4 * 1001, 32 * 4 * 1001)
    if rank == 0:
        q.put(got)
    tp.destroy()


def test_sampling_in_spans_on_two_ranks_matches_one_whole_batch(tmp_path):
    """A wide step samples in spans of rows, each span's logits gathered over the tp ranks: -tp 2 with spans
    of 16 rows draws and reports what -tp 1 does with the 40 rows sampled at once."""
    from tests.tiny_models import make_tiny_checkpoint
    from workers.models.registry import build_model

    folder = make_tiny_checkpoint("llama", tmp_path / "llama", vocab_size=1001)
    one = build_model(load_hf_config(folder), torch.float32, "cpu")
    one.load_weights(iter_safetensors(folder))
    want, whole = runner_steps(one, 0, 1 << 40)
    assert whole == [40] * 3  # one span, one product a step
    got, products = _run_ranks(_rank_sampling, 2, str(folder))
    assert products == [20, 20] * 3
    for (ids_a, lp_a, top_a), (ids_b, lp_b, top_b) in zip(want, got):
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < LP_TOL
        assert max(abs(a - b) for ra, rb in zip(top_a, top_b) for a, b in zip(ra, rb)) < LP_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_multiplies_several_spans_at_once_and_rows_keep_their_bits(tmp_path, dtype):
    """On CPU the LM head multiplies a few sampling spans' rows in one product (each product streams every weight
    of the head: Qwen3's is 311 MB in bf16) and the sampler widens a span's rows to fp32 logits as it reaches it:
    products of at most 32 rows (two of 20) and spans of 16 (the second straddling them) give every row the tokens,
    logprobs and top-2 of one whole product."""
    from tests.tiny_models import make_tiny_checkpoint
    from workers.models.registry import build_model

    folder = make_tiny_checkpoint("llama", tmp_path / "llama", vocab_size=1001)
    model = build_model(load_hf_config(folder), dtype, "cpu")
    model.load_weights(iter_safetensors(folder))
    want, whole = runner_steps(model, 0, 1 << 40)
    assert whole == [40] * 3
    got, products = runner_steps(model, 0, 16 * 4 * 1001, 32 * dtype.itemsize * 1001)  # the product's own dtype
    assert products == [20, 20] * 3
    assert got == want


# ----------------------------------------------------------------------------- tiny Qwen3-MoE, ipc


class TestMoE:
    """-tp 1 and -tp 2 engines on the same tiny Qwen3-MoE (4 heads, 2 KV heads, 8 experts), ipc backend."""

    @pytest.fixture(scope="class")
    def tp1(self, tmp_path_factory, moe_folder):
        s = serve(tmp_path_factory.mktemp("tp1"), moe_folder, 1, "ipc", "--enable-return-routed-experts",
                  "--enable-trace-replay")
        yield s
        s.stop()

    @pytest.fixture(scope="class")
    def tp2(self, tmp_path_factory, moe_folder, tp1):
        s = serve(tmp_path_factory.mktemp("tp2"), moe_folder, 2, "ipc", "--enable-return-routed-experts",
                  "--enable-trace-replay", "--enable-sleep-mode")
        yield s
        s.stop()

    def test_greedy_tokens_logprobs_prompt_logprobs_and_routes_match_tp1(self, tp1, tp2):
        for prompt in PROMPTS:
            ref = generate(tp1.url, prompt, prompt_logprobs=2)
            got = generate(tp2.url, prompt, prompt_logprobs=2)
            assert_same_generation(ref, got)
            assert len(ref["prompt_logprobs"]) == len(got["prompt_logprobs"]) == len(prompt)
            for pa, pb in zip(ref["prompt_logprobs"][1:], got["prompt_logprobs"][1:]):
                assert pa.keys() == pb.keys()
                assert max(abs(pa[k]["logprob"] - pb[k]["logprob"]) for k in pa) < LP_TOL
            # the router is replicated: rank 0's routes are every rank's, and equal to -tp 1's
            routes = got["choices"][0]["routed_experts"]
            assert routes and routes == ref["choices"][0]["routed_experts"]

    def test_seeded_sampling_and_trace_replay_match_tp1(self, tp1, tp2):
        seeded = dict(temperature=1.0, seed=7, max_tokens=10)
        assert_same_generation(generate(tp1.url, PROMPTS[0], **seeded), generate(tp2.url, PROMPTS[0], **seeded))
        trace = dict(trace_decode_token_ids=[9, 8, 7, 6, 5], max_tokens=5)
        ref, got = generate(tp1.url, PROMPTS[1], **trace), generate(tp2.url, PROMPTS[1], **trace)
        assert got["choices"][0]["token_ids"] == [9, 8, 7, 6, 5]
        assert_same_generation(ref, got)

    def test_each_worker_holds_half_of_the_weights_and_the_kv_cache(self, tp1, tp2):
        one = workers_info(tp1.url)["worker-0"]
        two = workers_info(tp2.url)
        assert sorted(two) == ["worker-0", "worker-1"]
        for w in two.values():
            # measured by each worker from its own parameter storage and KV tensor; the norms and the router
            # are replicated, so a little over half
            assert 0.5 <= w["weight_bytes"] / one["weight_bytes"] < 0.53, (w["weight_bytes"], one["weight_bytes"])
            assert w["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]  # same blocks, half the KV heads
            assert w["tensor_parallel_size"] == 2
        assert {w["tp_rank"] for w in two.values()} == {0, 1}

    def test_world_size_and_server_info_report_tp(self, tp2):
        assert httpx.get(tp2.url + "/get_world_size").json() == {"world_size": 2}
        assert httpx.get(tp2.url + "/get_world_size?include_dp=false").json() == {"world_size": 2}
        pc = httpx.get(tp2.url + "/server_info?config_format=json").json()["vllm_config"]["parallel_config"]
        assert (pc["tensor_parallel_size"], pc["world_size"]) == (2, 2)

    def test_weight_checker_keys_are_per_shard(self, tp2, moe_folder):
        sums = checksums(tp2.url)
        assert any(k.startswith("dp0:pp0:pcp0:tp1:") for k in sums)
        baseline = shard_checksums(load_hf_config(moe_folder), iter_safetensors(moe_folder), 2)
        assert baseline.keys() == sums.keys()
        assert compare(tp2.url, baseline) == {"match": True, "mismatches": []}

    def test_an_ipc_update_reaches_every_shard_bitwise(self, tp1, tp2, moe_folder):
        update = perturbed(moe_folder, seed=1)
        for s in (tp1, tp2):
            with WeightSyncClient(s.url, backend="ipc", packed=True, packed_buffer_size_bytes=256 << 10) as c:
                c.send_weights(update, version="v1", pause="keep")
        assert compare(tp2.url, shard_checksums(load_hf_config(moe_folder), update, 2)) == {
            "match": True, "mismatches": []}
        assert_same_generation(generate(tp1.url, PROMPTS[0]), generate(tp2.url, PROMPTS[0]))

    def test_sleep_wake_and_pauses_on_sharded_workers(self, tp1, tp2):
        url = tp2.url
        before = generate(url, PROMPTS[1])
        r = httpx.post(url + "/sleep?level=1", timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
        assert_same_generation(before, generate(url, PROMPTS[1]))
        for mode in ("abort", "keep", "wait"):
            assert httpx.post(url + f"/pause?mode={mode}", timeout=60).status_code == 200, mode
            assert httpx.post(url + "/resume", timeout=60).status_code == 200, mode
        assert_same_generation(before, generate(url, PROMPTS[1]))

    def test_an_abort_pause_mid_generation_ends_the_step_on_every_rank(self, tp2):
        """A long request running while an abort pause arrives: the step ends on both ranks (they stay in
        step: the next request is served and matches what it was)."""
        url = tp2.url
        before = generate(url, PROMPTS[0])
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(httpx.post(url + "/inference/v1/generate", timeout=120, json={
            "token_ids": PROMPTS[1], "sampling_params": {"max_tokens": 100, "ignore_eos": True}})))
        t.start()
        _wait_running(tp2)
        assert httpx.post(url + "/pause?mode=abort", timeout=60).status_code == 200
        t.join(120)
        assert out and out[0].status_code in (200, 503)
        assert httpx.post(url + "/resume", timeout=60).status_code == 200
        assert_same_generation(before, generate(url, PROMPTS[0]))

    def test_reload_weights_gives_every_worker_its_part_of_the_checkpoint(self, tp2, moe_folder):
        """The level-2 sleep recipe's reload_weights reads whole checkpoint tensors; each worker keeps its part."""
        r = httpx.post(tp2.url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120)
        assert r.status_code == 200, r.text
        baseline = shard_checksums(load_hf_config(moe_folder), iter_safetensors(moe_folder), 2)
        assert compare(tp2.url, baseline) == {"match": True, "mismatches": []}

    def test_a_worker_of_another_model_is_refused_naming_it(self, tp2, tmp_path, smollm2_dir):
        """A worker started with other flags (another model) cannot join the engine: the coordinator refuses
        its Hello, naming the model, and the worker exits."""
        bus = next(p for p in tp2.log_path.parent.iterdir() if p.name.startswith("bus-"))
        r = subprocess.run([sys.executable, "-m", "engine.cli", "worker", "--rank", "7", str(smollm2_dir),
                            "--port", str(tp2.port), "--bus-dir", str(bus), "--num-gpu-blocks-override", "8",
                            "--max-model-len", "64"], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert r.returncode != 0
        assert "started with other flags than the coordinator: model" in r.stderr and str(smollm2_dir) in r.stderr
        assert generate(tp2.url, PROMPTS[0])["choices"][0]["token_ids"]  # the engine goes on serving


# ------------------------------------------------------------------------ tiny Qwen3-MoE, collective


class TestCollective:
    """-tp 2 engine with the collective backend (Gloo on CPU): the trainer is rank 0, the workers 1 and 2."""

    @pytest.fixture(scope="class")
    def tp2(self, tmp_path_factory, moe_folder):
        work = tmp_path_factory.mktemp("tp2c")
        s = serve(work, moe_folder, 2, "gloo", "--weights-recovery-dir", str(work / "recovery"))
        yield s
        s.stop()

    @pytest.mark.parametrize("packed", [True, False])
    def test_a_collective_update_reaches_every_shard_bitwise(self, tp2, moe_folder, packed):
        update = perturbed(moe_folder, seed=10 + packed)
        with WeightSyncClient(tp2.url, backend="nccl", packed=packed, packed_buffer_size_bytes=256 << 10) as c:
            c.send_weights(update, version=f"c-{packed}", pause="abort")
            assert compare(tp2.url, shard_checksums(load_hf_config(moe_folder), update, 2)) == {
                "match": True, "mismatches": []}
            second = perturbed(moe_folder, seed=20 + packed)
            c.send_weights(second, version=f"c-{packed}-2", pause=None)  # the same group again
        assert compare(tp2.url, shard_checksums(load_hf_config(moe_folder), second, 2)) == {
            "match": True, "mismatches": []}
        assert generate(tp2.url, PROMPTS[0])["choices"][0]["token_ids"]

    def test_a_killed_tp_worker_fails_its_step_and_the_group_forms_again(self, tp2, moe_folder):
        """SIGKILL tp rank 1 mid-generation: the request fails at once (503, not a hang), rank 0's collective
        fails and it leaves too, the launcher restarts both, they form a new group and each restores its own
        shard of the last update from --weights-recovery-dir."""
        url = tp2.url
        before = generate(url, PROMPTS[0])
        out: list[httpx.Response] = []
        long = {"token_ids": PROMPTS[1], "sampling_params": {"max_tokens": 100, "ignore_eos": True}}
        t = threading.Thread(target=lambda: out.append(httpx.post(url + "/inference/v1/generate", timeout=120,
                                                                  json=long)))
        t.start()
        _wait_running(tp2)
        old = tp2.child_pids()
        os.kill(old["worker-1"], signal.SIGKILL)
        t.join(60)
        assert out and out[0].status_code == 503 and "worker-1" in out[0].text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = httpx.post(url + "/inference/v1/generate", timeout=60, json={"token_ids": PROMPTS[0],
                           "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}})
            if r.status_code == 200:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        new = tp2.child_pids()
        assert new["worker-0"] != old["worker-0"] and new["worker-1"] != old["worker-1"]
        assert_same_generation(before, r.json())


# --------------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
class TestSmolLM2:
    """SmolLM2-135M (9 heads, 3 KV heads: -tp 2 is refused, -tp 3 splits both) against -tp 1."""

    @pytest.fixture(scope="class")
    def servers(self, tmp_path_factory, smollm2_dir):
        one = serve(tmp_path_factory.mktemp("smol1"), smollm2_dir, 1, "ipc")
        try:
            three = serve(tmp_path_factory.mktemp("smol3"), smollm2_dir, 3, "ipc")
        except Exception:
            one.stop()
            raise
        yield one, three
        three.stop()
        one.stop()

    def test_tp3_matches_tp1_and_each_worker_holds_a_third(self, servers):
        """30 fp32 layers: -tp 1 differs from itself by up to 2.7e-5 in a logprob between 1 and 2 torch threads
        (a GEMV's reduction order), so the bound here is that noise floor, not the tiny model's 1e-5."""
        one, three = servers
        for prompt in PROMPTS:
            assert_same_generation(generate(one.url, prompt, max_tokens=16), generate(three.url, prompt, max_tokens=16),
                                   tol=SMOL_LP_TOL)
        w1 = workers_info(one.url)["worker-0"]
        for w in workers_info(three.url).values():
            assert 1 / 3 <= w["weight_bytes"] / w1["weight_bytes"] < 0.34
            assert w["kv_cache_bytes"] * 3 == w1["kv_cache_bytes"]
