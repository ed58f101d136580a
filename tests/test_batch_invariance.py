"""Batch invariance (rl_config.enable_batch_invariant / VLLM_BATCH_INVARIANT=1): a request's numbers are the
same bits whatever else runs with it. Floats are compared as their bits (int32/int16 views), never with a
tolerance. Kernel and model level on tiny checkpoints (fp32 and bf16, dense and MoE), then end to end
over HTTP: alone vs mixed, prefill budget 2048 vs 16 with preemption, prefix-cache hit vs miss, and a
generated token's sampled logprob vs its prompt logprob when the text is sent back."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from ascend_ops import attention, cpu_kernels, ops
from ascend_ops import batch_invariant as bi
from ascend_ops.batch_invariant import DEFAULT, INVARIANT, linear
from ascend_ops.batch_invariant_check import BatchInvarianceUnavailable, self_check
from bench import batch_invariance as bench
from engine.rl_config import determinism, parse_additional_config, worker_env_updates
from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.tiny_models import PagedRunner, make_tiny_checkpoint, random_prompt
from workers.models.checkpoint import iter_safetensors, load_hf_config
from workers.models.registry import build_model

pytestmark = pytest.mark.timeout(600)
ON = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n, bias", [(576, 1536, False), (64, 1000, True), (160, 64, False)])
def test_linear_rows_are_the_same_bits_for_every_batch_size_and_position(dtype, k, n, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(300, k, generator=g).to(dtype)
    alone = torch.cat([linear(x[i:i + 1], w, b) for i in range(40)])
    for m in range(1, 257):
        out = linear(x[:m], w, b)
        assert same(out[:40], alone[:m]), f"rows of a {m}-row product differ from the same rows alone"
    for start in (1, 3, 17, 39):  # the same rows at other positions of the batch
        assert same(linear(x[start:start + 100], w, b)[:40 - start], alone[start:])


def test_plain_f_linear_is_not_batch_invariant_in_fp32_on_this_cpu():
    """Why the invariant linear exists: the default kernel's row 0 changes with the row count (MKL)."""
    if torch.device("cpu") != torch.empty(0).device or not torch.backends.mkl.is_available():
        pytest.skip("measured on MKL's CPU GEMM")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(64, 576, generator=g)
    rows = [DEFAULT.linear(x[:m], w)[:1] for m in (1, 2, 7, 64)]
    assert not all(same(rows[0], r) for r in rows[1:])


ACTIVATIONS = {  # Kernels op -> f(rows [T, 2 * width]) of the invariant set (gpt-oss's limit 7.0 as released)
    "silu_and_mul": lambda k, w: lambda x: k.silu_and_mul(x[:, :w], x[:, w:]),
    "gelu_tanh_and_mul": lambda k, w: lambda x: k.gelu_tanh_and_mul(x[:, :w], x[:, w:]),
    "clamped_swiglu": lambda k, w: lambda x: k.clamped_swiglu(x, 1.702, 7.0),
    "tanh": lambda k, w: lambda x: k.tanh(x[:, :w] / 30.0) * 30.0,  # Gemma 3's logit cap
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [160, 48, 1536])
@pytest.mark.parametrize("op", list(ACTIVATIONS))
def test_activation_rows_are_the_same_bits_when_a_thread_split_falls_inside_them(op, dtype, width):
    """torch splits an elementwise op of >= 32768 elements between threads at an element index, and runs the
    scalar kernel on each part's tail: a row cut by the split used to get other SiLU bits than alone (the
    cause of issue 12's 1-in-4 failure of the alone-vs-mixed HTTP test); F.gelu (Gemma 3) and sigmoid
    (gpt-oss's SwiGLU) have the same two kernels that differ, tanh (Gemma 3's logit cap) may."""
    f = ACTIVATIONS[op](INVARIANT, width)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2 * 32768 // width + 9, 2 * width, generator=g) * 4).to(dtype)
    for n in list(range(32768 // width + 1, x.shape[0], 2))[:40]:  # odd counts: two threads split row n // 2
        full = f(x[:n])
        for j in (0, n // 2, n - 1):
            assert same(full[j:j + 1], f(x[j:j + 1])), (n, j)


def test_invariant_activations_equal_hfs_within_float_rounding():
    """The exp forms of ascend_ops.invariant_activations against the default ones (HF's expressions), fp32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 320, generator=g) * 6
    for op in ("gelu_tanh_and_mul", "clamped_swiglu", "tanh"):
        got, want = ACTIVATIONS[op](INVARIANT, 160)(x), ACTIVATIONS[op](DEFAULT, 160)(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), op
    big = torch.tensor([[1e30, -1e30, 100.0, -100.0, 0.0, -0.0]])
    assert INVARIANT.tanh(big).tolist() == [[1.0, -1.0, 1.0, -1.0, 0.0, 0.0]]
    assert same(INVARIANT.gelu_tanh_and_mul(big, torch.ones_like(big)), torch.tensor([[1e30, -0., 100., -0., 0., -0.]]))


def _plain_silu_rows_differ() -> bool:
    """Whether the default F.silu gives a row that a thread split cuts other bits than the row alone, on this
    CPU (measured: yes with AVX-512 (Zen 4, Xeon), where a thread's tail is computed another way; no on an
    AVX2-only EPYC (Zen 3))."""
    return not _rows_alike(lambda x: ops.silu_and_mul(x[:, :160], x[:, 160:]))


def _rows_alike(f) -> bool:
    """Whether f gives the row a two-thread split cuts the bits it gives that row alone (fp32, [T, 320])."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(420, 320, generator=g) * 4
    return all(same(f(x[:n])[n // 2], f(x[n // 2:n // 2 + 1])[0]) for n in range(205, 420, 2))


def test_plain_f_silu_is_not_batch_invariant_in_fp32_on_this_cpu():
    """Why the invariant SiLU exists: with two threads, F.silu gives the row a thread split cuts other bits
    (on CPUs with AVX-512; on an AVX2-only CPU it happens to keep one order, and this says so)."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs two intra-op threads (the split is between threads)")
    if not _plain_silu_rows_differ():
        pytest.skip("F.silu keeps one order across thread splits on this CPU (seen on AVX2-only CPUs)")
    assert _plain_silu_rows_differ()


BACKENDS = ["kernel", "torch"] if cpu_kernels.ops() is not None else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The invariant attention this test runs: the CPU kernel and the torch path (what
    ROLLBUS_CPU_ATTENTION=torch or a machine without a compiler gets), set as the process's choice (given back
    after the test by tests/conftest.py)."""
    bi._attention_choice[:] = [request.param]
    return request.param


def test_invariant_attention_runs_the_cpu_kernel_for_every_row_where_it_builds():
    """Decodes and prefill chunks of any length (here 40 rows, past default mode's 16-row kernel limit)
    are the kernel's rows, each with its own context: the step's output is the kernel's, bit for bit."""
    if cpu_kernels.ops() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable()}")
    from ascend_ops.attention import AttentionMetadata, PrefillChunk

    assert bi.attention_backend() == "kernel"
    assert bi.attention_implementation("cpu", torch.float32) == "batch_invariant_cpu_kernel"
    assert bi.attention_implementation("cpu", torch.float16) == "batch_invariant_torch"
    g = torch.Generator().manual_seed(0)
    hq, hk, d, bs = 6, 2, 16, 4
    kc, vc = torch.randn(40, bs, hk, d, generator=g), torch.randn(40, bs, hk, d, generator=g)
    q = torch.randn(42, hq, d, generator=g)
    table = torch.arange(30, 19, -1)  # 11 blocks, reversed; the chunk's 40 rows are positions 2..41
    meta = AttentionMetadata(torch.arange(20 * bs, 20 * bs + 42), num_decodes=2,
                             decode_block_tables=torch.tensor([[3, 7, 0], [5, 0, 0]]),
                             decode_ctx_lens=torch.tensor([9, 2]), decode_max_ctx=9,
                             prefills=[PrefillChunk(2, 40, 42, table)])
    k, v = (torch.randn(42, hk, d, generator=g) for _ in range(2))
    out = INVARIANT.paged_attention(q, k, v, kc, vc, meta, 0.25)
    want = torch.empty_like(q)
    ops = cpu_kernels.ops()
    ops.paged_attention_rows(want[:2], q[:2], kc, vc, meta.decode_block_tables, bi._NO_ROWS, meta.decode_ctx_lens, 0.25)
    ops.paged_attention_rows(want[2:], q[2:], kc, vc, table.view(1, -1), torch.zeros(40, dtype=torch.int64),
                             torch.arange(3, 43), 0.25)
    assert same(out, want)


def test_the_attention_choice_is_made_once_per_process_and_follows_rollbus_cpu_attention():
    code = ("import torch; from ascend_ops import attention, batch_invariant as bi; "
            "a = bi.attention_implementation('cpu', torch.float32); attention.select('kernel'); "
            "print(a, bi.attention_implementation('cpu', torch.float32))")
    env = {**os.environ, "ROLLBUS_CPU_ATTENTION": "torch", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["batch_invariant_torch", "batch_invariant_torch"], r.stderr[-2000:]


def _load(folder: Path, dtype: torch.dtype, kern):
    m = build_model(load_hf_config(folder), dtype, "cpu", kernels=kern)
    m.load_weights(iter_safetensors(folder))
    return m


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    return {a: make_tiny_checkpoint(a, root / a) for a in ("llama", "qwen3_moe", "qwen2_moe", "glm4_moe", "gemma3",
                                                           "gpt_oss")}


def _three_ways(model, prompt: list[int], steps: int):
    """(alone, mixed, one prefill): the logits rows that chose each generated token, and the routes."""
    V = model.cfg.vocab_size
    r = PagedRunner(model, num_blocks=128, block_size=4)
    routes: list[torch.Tensor] = []
    rows = [r.step(prefills=[(0, prompt)], routed_experts=routes)[-1]]
    toks = []
    for _ in range(steps):
        toks.append(int(rows[-1].argmax()))
        rows.append(r.step(decodes=[(0, toks[-1])])[0])
    alone = torch.stack(rows[:-1])
    alone_routes = torch.stack(routes, 1) if routes else None
    # mixed: other sequences before and after ours, our prompt in chunks of 5, decodes among others
    r = PagedRunner(model, num_blocks=128, block_size=4, seed=3)
    others = {i: random_prompt(7 + 3 * i, V, 10 + i) for i in range(1, 5)}
    r.step(prefills=[(1, others[1]), (2, others[2])])
    routes = []
    r.step(decodes=[(1, 5)], prefills=[(3, others[3]), (0, prompt[:5])])
    r.step(decodes=[(2, 7), (1, 3)], prefills=[(0, prompt[5:10]), (4, others[4])])
    last = r.step(decodes=[(2, 7), (3, 9), (4, 1)], prefills=[(0, prompt[10:])], routed_experts=routes)
    mixed = [last[-1]]
    for i, t in enumerate(toks[:-1]):
        batch = [[(0, t)], [(3, 2), (0, t)], [(3, 2), (2, 1), (4, 5), (0, t)]][i % 3]
        mixed.append(r.step(decodes=batch)[[s for s, _ in batch].index(0)])
    one = PagedRunner(model, num_blocks=128, block_size=4, seed=5)
    full_routes: list[torch.Tensor] = []
    prefilled = one.step(prefills=[(0, prompt + toks[:-1])], routed_experts=full_routes)[len(prompt) - 1:]
    return alone, torch.stack(mixed), prefilled, alone_routes, full_routes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# qwen2_moe: sliding windows and a shared expert; glm4_moe: an fp32 grouped sigmoid router, partial rotary;
# gemma3: GELU, sliding layers around a global one, the logit soft-cap; gpt-oss: sinks, alternating windows,
# biased transposed experts with the clamped SwiGLU
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen2_moe", "glm4_moe", "gemma3", "gpt_oss"])
def test_a_sequence_gets_the_same_bits_alone_mixed_chunked_and_as_one_prefill(tiny_folders, arch, dtype, backend):
    model = _load(tiny_folders[arch], dtype, INVARIANT)
    prompt = random_prompt(13, model.cfg.vocab_size, 1)
    alone, mixed, prefilled, alone_routes, full_routes = _three_ways(model, prompt, 10)
    assert same(alone, mixed), "decoding among other sequences / chunked prefill changed the bits"
    assert same(alone, prefilled), "a position computed in a prefill differs from the same position decoded"
    if alone_routes is not None:  # routed experts of the prompt: alone vs inside the long prefill
        assert torch.equal(alone_routes, torch.stack(full_routes, 1)[:len(prompt)])


@pytest.mark.unit
def test_server_info_names_the_path_that_sink_and_sliding_window_layers_take(tiny_folders):
    """/server_info's `attention` (workers.startup.attention_paths): gpt-oss's sink attention runs the invariant
    attention in both modes (the row kernel, which adds each head's sink to its denominator, where it runs);
    sliding-window layers take the process's kernels (both read a row's window)."""
    from workers.startup import attention_paths

    f32 = torch.float32
    for kern, main in ((INVARIANT, "batch_invariant_cpu_kernel"), (DEFAULT, "cpu_paged_kernel")):
        if (bi.attention_implementation if kern is INVARIANT else attention.implementation)("cpu", f32, f32) != main:
            pytest.skip("the CPU attention kernel is not built or not selected here")
        assert attention_paths(_load(tiny_folders["gemma3"], f32, kern), "cpu", f32, f32) == main
        # gpt-oss's sink attention: the invariant attention's rows in both modes (the row kernel adds the sinks)
        assert attention_paths(_load(tiny_folders["gpt_oss"], f32, kern), "cpu", f32, f32) == \
            bi.attention_implementation("cpu", f32, f32)
        assert attention_paths(_load(tiny_folders["llama"], f32, kern), "cpu", f32, f32) == main


def test_gpt_oss_experts_copy_follows_a_weight_update(tiny_folders):
    """Under --batch-invariant gpt-oss multiplies its experts on a cached [E, out, in] copy (Kernels.experts_nk):
    after an update of the experts by their HF names the model computes what one loaded with the new weights
    does, bit for bit (the copy of the old values is dropped, not read)."""
    folder = tiny_folders["gpt_oss"]
    model = _load(folder, torch.float32, INVARIANT)
    prompt = random_prompt(9, model.cfg.vocab_size, 1)
    before = PagedRunner(model, num_blocks=32, block_size=4).step(prefills=[(0, prompt)])
    new = {n: w * 1.5 if ".experts." in n else w for n, w in iter_safetensors(folder)}
    model.load_weights((n, w) for n, w in new.items() if ".experts." in n)
    after = PagedRunner(model, num_blocks=32, block_size=4).step(prefills=[(0, prompt)])
    fresh = build_model(load_hf_config(folder), torch.float32, "cpu", kernels=INVARIANT)
    fresh.load_weights(new.items())
    assert not same(after, before)
    assert same(after, PagedRunner(fresh, num_blocks=32, block_size=4).step(prefills=[(0, prompt)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_gets_the_same_bits_in_a_step_large_enough_for_threads_to_split_its_rows(tiny_folders, dtype):
    """The composition issue 12's HTTP test hit about 1 run in 4 (a step of ~300 rows: 12 prefills), made
    deterministic: 261 rows, so the dense MLP's [261, 160] SiLU is split between two threads in the middle
    of row 130, which is one of our prompt's rows; before the fix its bits (and those of the rows after
    it, through the KV cache) differed from the prompt computed alone."""
    model = _load(tiny_folders["qwen3_moe"], dtype, INVARIANT)
    V = model.cfg.vocab_size
    prompt = random_prompt(40, V, 1)
    alone = PagedRunner(model, num_blocks=128, block_size=4).step(prefills=[(0, prompt)])
    for before in (92, 110, 125):
        r = PagedRunner(model, num_blocks=128, block_size=4, seed=2)
        out = r.step(prefills=[(1, random_prompt(before, V, 2)), (0, prompt), (2, random_prompt(221 - before, V, 3))])
        assert same(out[before:before + 40], alone), f"{before} rows before ours changed our bits"


def test_self_check_passes_the_invariant_kernels_and_names_what_is_not(tiny_folders, backend):
    for arch, act in (("llama", "silu_and_mul"), ("qwen3_moe", "silu_and_mul"), ("gemma3", "gelu_tanh_and_mul"),
                      ("gpt_oss", "clamped_swiglu")):
        checked = self_check(_load(tiny_folders[arch], torch.float32, INVARIANT), block_size=16)
        assert {"linear", "paged_attention", "rms_norm", "rotary", "log_softmax", act} <= set(checked)
        assert ("moe" in checked) == (arch in ("qwen3_moe", "gpt_oss"))
        assert ("tanh" in checked) == (arch == "gemma3")  # its logit soft-cap
    # HF's GELU (F.gelu) and gpt-oss's sigmoid: their kernels give a row cut by a thread split other bits
    for arch, op in (("gemma3", "gelu_tanh_and_mul"), ("gpt_oss", "clamped_swiglu")):
        plain = dataclasses.replace(INVARIANT, **{op: getattr(ops, op)})
        if torch.get_num_threads() >= 2 and not _rows_alike(ACTIVATIONS[op](plain, 160)):
            with pytest.raises(BatchInvarianceUnavailable, match=rf"the {op} \[\d+\] kernel"):
                self_check(_load(tiny_folders[arch], torch.float32, plain), block_size=16)
    # plain F.linear (not padded, not packed: what default mode ran before it packed weights) is not
    with pytest.raises(BatchInvarianceUnavailable, match=r"cpu \(float32\): the linear \[64 -> 1000\] kernel"):
        self_check(_load(tiny_folders["llama"], torch.float32, dataclasses.replace(INVARIANT, linear=F.linear)),
                   block_size=16)
    # default mode's attention (prefill chunks on the chunk kernel, decodes on the row kernel: two summation
    # orders) is not; in fp32 the probe sees it (in bf16 the output's rounding hides it at the probe's sizes since
    # bf16 prefill chunks left torch's masked SDPA)
    with pytest.raises(BatchInvarianceUnavailable, match="paged attention"):
        self_check(_load(tiny_folders["llama"], torch.float32, DEFAULT), block_size=16)
    # the default F.silu: the self-check refuses it exactly where a row cut by a thread split gets other bits
    plain_silu = _load(tiny_folders["llama"], torch.float32,
                       dataclasses.replace(INVARIANT, silu_and_mul=ops.silu_and_mul))
    if torch.get_num_threads() >= 2 and _plain_silu_rows_differ():
        with pytest.raises(BatchInvarianceUnavailable, match=r"the silu_and_mul \[160\] kernel"):
            self_check(plain_silu, block_size=16)
    else:
        assert "silu_and_mul" in self_check(plain_silu, block_size=16)


def test_the_docs_table_of_architectures_says_which_run_invariant():
    """docs/batch-invariance.md lists every registered architecture once, "yes" exactly where the code builds
    it on the invariant kernels (no `no_batch_invariance` refusal)."""
    import re

    from workers.models.registry import ARCHITECTURES

    text = (Path(__file__).resolve().parents[1] / "docs" / "batch-invariance.md").read_text()
    section = text.split("## Which architectures", 1)[1].split("\n## ", 1)[0]
    rows = {a: cells[1].strip().startswith("yes") for line in section.splitlines()
            if line.startswith("| `") and (cells := line.strip("|").split("|"))
            for a in re.findall(r"`(\w+)`", cells[0])}
    assert rows == {a: not cls.no_batch_invariance for a, cls in ARCHITECTURES.items()}


# --- flags -----------------------------------------------------------------------------------------

def test_flags_env_and_refusals():
    assert determinism(parse_additional_config(ON), {}).batch_invariant
    assert determinism(parse_additional_config(ON), {}).source == "rl_config.enable_batch_invariant"
    without = parse_additional_config('{"rl_config": {"enable_batch_invariant": true}}')
    assert not determinism(without, {}).batch_invariant  # ignored without `enabled`, as the seed says
    assert worker_env_updates(without, {}) == {}
    plain = parse_additional_config(None)
    assert determinism(plain, {"VLLM_BATCH_INVARIANT": "1"}).source == "VLLM_BATCH_INVARIANT=1"
    assert not determinism(plain, {"VLLM_BATCH_INVARIANT": "0"}).batch_invariant
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be an integer"):
        determinism(plain, {"VLLM_BATCH_INVARIANT": "yes"})
    tc = determinism(parse_additional_config('{"rl_config": {"enabled": true, "enable_training_consistency": true}}'))
    assert tc.batch_invariant and tc.training_consistency
    assert not determinism(parse_additional_config('{"rl_config": {"enable_training_consistency": true}}'), {}) \
        .training_consistency  # ignored without enabled
    env = worker_env_updates(parse_additional_config(ON), {})
    assert env["HCCL_DETERMINISTIC"] == "strict" and env["LCCL_DETERMINISTIC"] == "1"
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert worker_env_updates(plain, {"VLLM_BATCH_INVARIANT": "1"})["HCCL_DETERMINISTIC"] == "strict"


@pytest.mark.parametrize("env, args, message", [
    ({"VLLM_BATCH_INVARIANT": "yes"}, (), "VLLM_BATCH_INVARIANT must be an integer"),
])
def test_serve_refuses_at_start_up(tmp_path, env, args, message):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tmp_path), *args],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr + r.stdout


# --- end to end ------------------------------------------------------------------------------------

# qwen3_moe: routed experts compared too; gemma3 and gpt_oss (slow: two servers each, about 2 min): mixed-window
# models, whose sliding layers read their own block tables (engine.window_blocks), freed behind the window,
# preempted and hit in the cache
@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("gemma3", marks=pytest.mark.slow),
                                        pytest.param("gpt_oss", marks=pytest.mark.slow)])
def servers(request, tmp_path_factory, smollm2_dir):  # noqa: F811
    work = tmp_path_factory.mktemp("bi-serve")
    folder = tiny_model_with_tokenizer(request.param, work / request.param, smollm2_dir, vocab_size=49152)
    wide, narrow = bench.start_pair(work, str(folder), "float32", ("--enable-return-routed-experts",),
                                    max_model_len=64)
    yield request.param, wide, narrow
    wide.stop()
    narrow.stop()


def test_requests_alone_and_mixed_preempted_cached_and_recomputed_are_bitwise_equal(servers):
    arch, wide, narrow = servers
    bodies = bench.make_requests(12, 12, 49152)
    result = bench.check(wide.url, narrow.url, bodies)
    assert result == {"mixed": [], "chunked_preempted": [], "recompute": [], "alone_twice": []}
    assert metric(narrow, "vllm:num_preemptions_total") > 0  # the tiny KV cache did preempt
    assert metric(wide, "vllm:prefix_cache_hits_total") > 0  # and the shared prefix was read from the cache
    first = bench.normalise(bench.asyncio.run(bench.run(wide.url, bodies[:1], together=False))[0])
    assert bool(first["routed_experts"]) == (arch != "gemma3"), "routed experts are part of what is compared"


def test_server_info_reports_invariance(servers):
    arch, wide, _ = servers
    info = httpx.get(wide.url + "/server_info", timeout=30).json()
    assert info["determinism"] == {"batch_invariant": True, "training_consistency": False,
                                   "source": "rl_config.enable_batch_invariant", "batch_invariant_active": True}
    (worker,) = info["workers"].values()
    assert worker["kernels"] == "batch_invariant" and "paged_attention" in worker["batch_invariant_checked"]
    main = "batch_invariant_cpu_kernel" if cpu_kernels.ops() is not None else "batch_invariant_torch"
    # every arch, gpt-oss's sink attention and Gemma 3's sliding layers included: the kernel, every row alone
    assert worker["attention"] == main


# --- training consistency: the trainer-side forward ------------------------------------------------

def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), S, dtype=torch.long), torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_trainer_forward_reproduces_the_engine_logprobs_bitwise(tmp_path, arch, dtype, backend):
    from transformers import AutoModelForCausalLM

    from engine.trainer import use_engine_kernels

    folder = make_tiny_checkpoint(arch, tmp_path / arch)
    engine = _load(folder, dtype, INVARIANT)
    prompts = [random_prompt(n, engine.cfg.vocab_size, s) for n, s in ((9, 1), (14, 2), (5, 3))]
    toks, logits = PagedRunner(engine, num_blocks=256, block_size=4).greedy(dict(enumerate(prompts)), 8)
    hf = use_engine_kernels(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), block_size=4)
    ids, mask = _padded([p + toks[i][:-1] for i, p in enumerate(prompts)])
    lp = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits, dim=-1)
    for i, p in enumerate(prompts):
        want = torch.log_softmax(logits[i].float(), -1).gather(1, torch.tensor(toks[i])[:, None])
        got = lp[i, len(p) - 1:len(p) + 7].gather(1, torch.tensor(toks[i])[:, None])
        assert same(got.detach(), want), f"rollout {i}: the trainer's logprobs differ from the engine's"


def test_trainer_backward_matches_plain_hf_and_bad_use_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from engine.trainer import use_engine_kernels

    folder = make_tiny_checkpoint("qwen3", tmp_path / "q")
    ids, mask = _padded([random_prompt(n, 1500, n) for n in (20, 13, 7)])
    grads = []
    for ours in (False, True):
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if ours:
            use_engine_kernels(m)
        out = m(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(out.float(), -1)[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
        (-(lp * mask[:, 1:]).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item()), name
    with pytest.raises(ValueError, match="right-padded"):
        m(input_ids=ids, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel"):
        from transformers import GPT2Config, GPT2LMHeadModel

        use_engine_kernels(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))


def test_trainer_attention_keeps_only_q_k_v_for_backward(backend):
    """The per-(row, key block) copies the engine kernel makes must not be kept for autograd (they made a
    16 x 110-token batch of SmolLM2 need 13 GB); saved bytes stay those of q, k and v whatever S is."""
    from engine.trainer.consistency import _attention

    attend = _attention(4)
    g = torch.Generator().manual_seed(0)
    for S in (16, 64):
        q = torch.randn(3, 6, S, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(3, 2, S, 8, generator=g, requires_grad=True) for _ in range(2))
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = attend(None, q, k, v, None, 8**-0.5)
        assert sum(saved) <= sum(t.numel() * t.element_size() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1),
                                                               v.repeat_interleave(3, 1), is_causal=True)
        w = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad((out * w).sum(), (q, k, v))
        want = torch.autograd.grad((ref.transpose(1, 2) * w).sum(), (q, k, v))
        assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def test_grpo_example_runs_with_ratio_exactly_one_across_weight_updates(tmp_path, smollm2_dir):  # noqa: F811
    """examples/grpo_consistency.py as docs/batch-invariance.md runs it, on a tiny model: rollout -> trainer
    forward -> ratio 1.0 for every token -> update -> weight sync -> the next rollout, twice."""
    folder = tiny_model_with_tokenizer("qwen3", tmp_path / "q3", smollm2_dir, vocab_size=49152)
    s = start_server(tmp_path, "--model", str(folder), "--enable-scale-out", "--weight-transfer-config",
                     '{"backend": "ipc"}', "--additional-config",
                     '{"rl_config": {"enabled": true, "enable_training_consistency": true}}')
    try:
        info = httpx.get(s.url + "/server_info", timeout=30).json()["determinism"]
        assert info["training_consistency"] and info["batch_invariant_active"]
        root = Path(__file__).resolve().parents[1]
        r = subprocess.run([sys.executable, str(root / "examples" / "grpo_consistency.py"), "--url", s.url,
                            "--model", str(folder)], capture_output=True, text=True, timeout=500, cwd=root)
    finally:
        s.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ratio exactly 1.0 for every token: True") == 2
    assert "pushed weights step-2" in r.stdout
