"""The CPU paged-attention kernel (ascend_ops/csrc, through ascend_ops.attention) against the torch SDPA path
and a plain per-sequence reference, on random paged caches: ragged context lengths, blocks scattered
in the cache, GQA and MHA, fp32 and bf16, head_dim 64 and 128 (and an odd one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from ascend_ops import attention, cpu_kernels
from ascend_ops.attention import AttentionMetadata, PrefillChunk
from tests.fixtures_models import smollm2_dir  # noqa: F401
from tests.server_helpers import free_port, start_server, tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parent.parent

BS = 16


@pytest.fixture(scope="module")
def kernel():  # (each test selects its path; tests/conftest.py gives the process's choice back after it)
    if cpu_kernels.ops() is None:
        pytest.fail(f"the CPU kernels did not build here: {cpu_kernels.unavailable()}")


def paged_case(lens: list[int], hq: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0, chunk: int = 0):
    """q/k/v of one step (one decode per sequence; with `chunk`, the last sequence instead computes its last
    `chunk` tokens as a prefill chunk), a cache whose blocks are shuffled, and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [(n + BS - 1) // BS for n in lens]
    perm = torch.randperm(sum(nblk) + 3, generator=gen)  # block ids scattered, some never used
    tables, at = [], 0
    for n in nblk:
        tables.append(perm[at:at + n])
        at += n
    k_cache = torch.randn(len(perm), BS, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(len(perm), BS, hk, d, generator=gen).to(dtype)
    decodes = len(lens) - (1 if chunk else 0)
    rows = decodes + chunk
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    k = torch.randn(rows, hk, d, generator=gen).to(dtype)
    v = torch.randn(rows, hk, d, generator=gen).to(dtype)
    slots = [tables[i][(n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens[:decodes])]
    prefills = []
    if chunk:
        n, t = lens[-1], tables[-1]
        pos = torch.arange(n - chunk, n)
        slots += (t[pos // BS] * BS + pos % BS).tolist()
        prefills.append(PrefillChunk(decodes, chunk, n, t))
    width = max(nblk[:decodes], default=1)
    dt = torch.zeros(decodes, width + 2, dtype=torch.int64)  # wider than needed, 0-padded, as the runner's
    for i in range(decodes):
        dt[i, :nblk[i]] = tables[i]
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), num_decodes=decodes,
                             decode_block_tables=dt, decode_ctx_lens=torch.tensor(lens[:decodes]),
                             decode_max_ctx=max(lens[:decodes], default=0), prefills=prefills)
    return q, k, v, k_cache, v_cache, meta, tables


def reference(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    """Per sequence, per head, in fp64: softmax(q k^T * scale) v over the sequence's own tokens."""
    hq, hk = q.shape[1], k_cache.shape[2]
    out = []
    for i, n in enumerate(lens):
        kc = k_cache[tables[i]].reshape(-1, hk, q.shape[2])[:n].double()
        vc = v_cache[tables[i]].reshape(-1, hk, q.shape[2])[:n].double()
        kc, vc = kc.repeat_interleave(hq // hk, dim=1), vc.repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].double(), kc) * scale
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), vc))
    return torch.stack(out)


def run(which: str, case, window: int = 0) -> torch.Tensor:
    q, k, v, k_cache, v_cache, meta, _ = case
    attention.select(which)
    return attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, q.shape[2] ** -0.5, window)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


LENS = [1, 5, 16, 17, 33, 100, 108, 250]  # one token, within a block, exactly a block, ragged


@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (4, 4, 128), (8, 2, 128), (6, 1, 40)])
def test_decode_matches_sdpa_and_the_reference_in_fp32(kernel, hq, hk, d) -> None:
    case = paged_case(LENS, hq, hk, d, torch.float32, seed=d + hq)
    got, sdpa = run("kernel", case), run("torch", case)
    q, _, _, k_cache, v_cache, meta, tables = case
    attention.paged_attention(q, case[1], case[2], k_cache, v_cache, meta, d ** -0.5)  # the new k/v written
    ref = reference(q, k_cache, v_cache, tables, LENS, d ** -0.5)
    assert rel_err(got, sdpa) < 1e-5 and rel_err(got, ref) < 1e-5, (rel_err(got, sdpa), rel_err(got, ref))
    assert rel_err(sdpa, ref) < 1e-5  # the two paths agree with the reference equally


@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (8, 2, 128)])
def test_decode_matches_sdpa_in_bf16(kernel, hq, hk, d) -> None:
    case = paged_case(LENS, hq, hk, d, torch.bfloat16, seed=1)
    got, sdpa = run("kernel", case), run("torch", case)
    assert got.dtype == torch.bfloat16
    # the kernel accumulates in fp32 and rounds once: within a bf16 rounding (2^-8) of SDPA's result
    assert rel_err(got, sdpa) < 2 ** -7, rel_err(got, sdpa)
    q, _, _, k_cache, v_cache, meta, tables = case
    attention.paged_attention(q, case[1], case[2], k_cache, v_cache, meta, d ** -0.5)
    assert rel_err(got, reference(q, k_cache, v_cache, tables, LENS, d ** -0.5)) < 2 ** -7


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("chunk", [1, 5, attention.KERNEL_CHUNK_ROWS, attention.KERNEL_CHUNK_ROWS + 4])
def test_a_mixed_step_decodes_and_a_prefill_chunk_match_sdpa(kernel, chunk, dtype, tol) -> None:
    """Chunks up to KERNEL_CHUNK_ROWS rows go through the kernel (each row sees the keys up to its own
    position), longer ones through SDPA; either way the same results as the torch path."""
    case = paged_case([3, 40, 77, 90], 9, 3, 64, dtype, seed=7, chunk=chunk)
    got, sdpa = run("kernel", case), run("torch", case)
    assert rel_err(got, sdpa) < tol, rel_err(got, sdpa)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("window, chunk", [(7, 0), (16, 0), (40, 0), (7, 5), (20, attention.KERNEL_CHUNK_ROWS),
                                           (20, 33)])
@pytest.mark.parametrize("hq, hk, d", [(9, 3, 64), (4, 2, 24)])
def test_a_sliding_window_in_the_kernels_matches_sdpa_and_never_reads_behind_it(kernel, hq, hk, d, window,
                                                                                 chunk, dtype, tol) -> None:
    """A sliding-window layer's decode rows and chunks go through the kernels (the row kernel; the chunk kernel
    past 16 rows where the head size is a multiple of 16), which read only each row's last `window` keys (windows
    shorter than a block, a block long, across blocks; a head size that is no multiple of 16): the torch path's
    results and, in fp32, the fp64 reference's, on tests/test_sliding_window_kv.py's case, whose tables point every
    block wholly before a row's window at a block of NaN (a read behind a window is a NaN, not a near miss)."""
    from tests.test_sliding_window_kv import _case, _reference

    lens = [3, 9, 40, 77, 90]
    case = _case(lens, chunk, dtype, window, BS, hq, hk, d)
    got, sdpa = run("kernel", case, window), run("torch", case, window)
    assert torch.isfinite(got).all()
    assert rel_err(got, sdpa) < tol, rel_err(got, sdpa)
    if dtype == torch.float32:
        q, k, v, k_cache, v_cache, _, real = case
        assert rel_err(got, _reference(q, k, v, k_cache, v_cache, real, lens, chunk, window, BS)) < 1e-5


@pytest.mark.parametrize("window, chunk", [(0, 0), (0, 20), (7, 5), (16, 33)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_attention_sinks_in_the_row_kernel_match_the_torch_path(kernel, window, chunk, dtype, tol) -> None:
    """gpt-oss's sink attention (ascend_ops.batch_invariant.sink_attention, both modes): every row through the row
    kernel, each head's sink logit one more term of its softmax denominator (and of its maximum: sinks above
    every score included), against the per-row torch path that was its only path before; with and without a
    window, decode rows and prefill chunks."""
    from ascend_ops import batch_invariant as bi

    case = paged_case([3, 40, 77, 90], 8, 2, 64, dtype, seed=11 + window + chunk, chunk=chunk)
    q, k, v, k_cache, v_cache, meta, _ = case
    sinks = torch.tensor([-2.0, 0.5, 3.0, 40.0, -40.0, 1.0, 0.0, 8.0]).to(dtype)  # 40: above every score
    bi._attention_choice[:] = ["kernel"]  # the invariant attention's choice (tests/conftest.py gives it back)
    got = bi.sink_attention(q, k, v, k_cache, v_cache, meta, 0.125, window, sinks)  # writes k / v
    want = bi._paged_attention_torch(q, k_cache, v_cache, meta, 0.125, window, sinks)
    assert rel_err(got, want) < tol, rel_err(got, want)


def narrow_cache(case, cache_dtype: torch.dtype):
    """The fp32 case with its caches in cache_dtype (--kv-cache-dtype): what the worker allocates."""
    q, k, v, k_cache, v_cache, meta, tables = case
    return q, k, v, k_cache.to(cache_dtype), v_cache.to(cache_dtype), meta, tables


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, d, chunk", [(9, 3, 64, 0), (8, 2, 128, 0), (6, 1, 40, 0), (9, 3, 64, 5),
                                              (9, 3, 64, attention.KERNEL_CHUNK_ROWS + 4)])
def test_a_16_bit_cache_under_fp32_queries_matches_sdpa_and_the_reference(kernel, cache_dtype, hq, hk, d,
                                                                          chunk) -> None:
    """--kv-cache-dtype bfloat16 / float16 under an fp32 model: this step's keys and values are stored rounded
    to 16 bits, then read exactly (widened), and attention computes in fp32. So against the fp64 reference
    over the rounded cache, the kernel and the torch path are as close as in fp32; the output is fp32."""
    lens = [3, 40, 77, 90] if chunk else LENS
    case = narrow_cache(paged_case(lens, hq, hk, d, torch.float32, seed=d + hq, chunk=chunk), cache_dtype)
    got, sdpa = run("kernel", case), run("torch", case)
    assert got.dtype == sdpa.dtype == torch.float32
    q, k, v, k_cache, v_cache, meta, tables = case
    attention.paged_attention(q, k, v, k_cache, v_cache, meta, d ** -0.5)  # the new k/v written, rounded
    assert k_cache.dtype == cache_dtype
    slots = meta.slot_mapping
    written = k_cache.view(-1, hk, d)[slots]
    assert torch.equal(written, k.to(cache_dtype)) and not torch.equal(written.float(), k)
    assert rel_err(got, sdpa) < 1e-5, rel_err(got, sdpa)
    if not chunk:
        ref = reference(q, k_cache, v_cache, tables, lens, d ** -0.5)
        assert rel_err(got, ref) < 1e-5 and rel_err(sdpa, ref) < 1e-5, (rel_err(got, ref), rel_err(sdpa, ref))
    # and within a 16-bit rounding of attention over the fp32 cache
    assert rel_err(got, run("kernel", paged_case(lens, hq, hk, d, torch.float32, seed=d + hq, chunk=chunk))) < 2 ** -6


def test_a_16_bit_cache_under_bf16_queries_goes_to_the_torch_path(kernel) -> None:
    """bf16 queries read only a bf16 cache in the kernel; a float16 cache under a bf16 model is served by
    the torch path (the cache widened to bf16), and reported so."""
    assert attention.kernel_reads(torch.bfloat16, torch.bfloat16)
    assert not attention.kernel_reads(torch.bfloat16, torch.float16)
    attention.select("kernel")
    assert attention.implementation("cpu", torch.bfloat16, torch.float16) == "torch_sdpa"
    assert attention.implementation("cpu", torch.float32, torch.float16) == "cpu_paged_kernel"
    case = narrow_cache(paged_case(LENS, 9, 3, 64, torch.bfloat16, seed=2), torch.float16)
    got = run("kernel", case)
    assert got.dtype == torch.bfloat16 and rel_err(got, run("torch", case)) == 0


def test_a_row_is_the_same_bits_whatever_else_is_in_the_batch(kernel) -> None:
    """Each (row, kv head) is computed alone, by one thread, in a fixed order."""
    case = paged_case(LENS, 9, 3, 64, torch.float32, seed=3)
    q, k, v, k_cache, v_cache, meta, _ = case
    ops = cpu_kernels.ops()
    full = torch.empty_like(q)
    ops.paged_attention_rows(full, q, k_cache, v_cache, meta.decode_block_tables, torch.empty(0, dtype=torch.int64),
                             meta.decode_ctx_lens, 0.125)
    for r in (0, 5, 7):
        one = torch.empty_like(q[r:r + 1])
        ops.paged_attention_rows(one, q[r:r + 1], k_cache, v_cache, meta.decode_block_tables[r:r + 1],
                                 torch.empty(0, dtype=torch.int64), meta.decode_ctx_lens[r:r + 1], 0.125)
        assert torch.equal(one, full[r:r + 1])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # how the rows are split between threads changes nothing either
            torch.set_num_threads(n)
            again = torch.empty_like(q)
            ops.paged_attention_rows(again, q, k_cache, v_cache, meta.decode_block_tables,
                                     torch.empty(0, dtype=torch.int64), meta.decode_ctx_lens, 0.125)
            assert torch.equal(again, full)
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_run_on_as_many_threads_as_torch(kernel) -> None:
    """The extension's at::parallel_for runs on torch's OpenMP threads. Built without -fopenmp, the header
    runs every parallel loop serially: all the kernels ran on one thread whatever torch.get_num_threads()
    said (attention took the same time at 1 and 2 threads)."""
    ops, threads = cpu_kernels.ops(), torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert ops.parallel_width(64) == n
            assert ops.parallel_width(1) == 1  # one item: one thread
    finally:
        torch.set_num_threads(threads)


def test_bad_tables_and_shapes_are_refused_with_an_error(kernel) -> None:
    q, _, _, k_cache, v_cache, meta, _ = paged_case([5, 40], 4, 2, 64, torch.float32)
    ops, none = cpu_kernels.ops(), torch.empty(0, dtype=torch.int64)
    out = torch.empty_like(q)
    bad = meta.decode_block_tables.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        ops.paged_attention_rows(out, q, k_cache, v_cache, bad, none, meta.decode_ctx_lens, 0.125)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ops.paged_attention_rows(out, q, k_cache, v_cache, meta.decode_block_tables, none,
                                 torch.tensor([5, 10_000]), 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.paged_attention_rows(out, q.double(), k_cache, v_cache, meta.decode_block_tables, none,
                                 meta.decode_ctx_lens, 0.125)


def test_the_choice_is_reported_and_an_unknown_one_refused(kernel, monkeypatch) -> None:
    attention.select("torch")
    assert attention.implementation("cpu") == "torch_sdpa"
    attention.select("kernel")
    assert attention.implementation("cpu") == "cpu_paged_kernel"
    assert attention.implementation("cuda") == "torch_sdpa"
    with pytest.raises(ValueError, match="ROLLBUS_CPU_ATTENTION must be one of kernel, torch, got 'fast'"):
        attention.select("fast")


# --- building, falling back, reporting ---------------------------------------------------------------

PROBE = ("from ascend_ops import attention; import torch; from tests.test_cpu_attention import paged_case, run; "
         "out = run('kernel', paged_case([5, 40], 4, 2, 64, torch.float32)); "
         "print('impl', attention.implementation('cpu'), bool(torch.isfinite(out).all()))")


def probe(env: dict[str, str], cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), cpu_kernels.CACHE_ENV: str(cache), **env})


def test_without_a_compiler_the_torch_path_serves_and_one_warning_says_why(tmp_path) -> None:
    out, err = probe({"CXX": "/nonexistent/c++"}, tmp_path).communicate(timeout=240)
    assert "impl torch_sdpa True" in out, out + err
    assert err.count("CPU kernels unavailable, using the torch path instead") == 1, err


@pytest.mark.slow  # compiles the extension into a fresh folder (~20-60 s)
def test_processes_starting_together_build_once_even_after_a_builder_was_killed(tmp_path) -> None:
    first = probe({}, tmp_path)
    folder = cpu_kernels.build_dir(cpu_kernels._source(), cpu_kernels.cflags()).name
    deadline = time.monotonic() + 120
    while not (tmp_path / folder / "main.cpp").exists():  # the build has begun: kill it mid-compile
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    first.kill()
    first.communicate(timeout=60)
    procs = [probe({}, tmp_path) for _ in range(3)]
    results = [p.communicate(timeout=600) for p in procs]
    assert all("impl cpu_paged_kernel True" in out for out, _ in results), results
    assert sum(err.count("compiling the CPU kernels") for _, err in results) == 1, results
    again = probe({}, tmp_path).communicate(timeout=120)  # cached: loaded without compiling
    assert "impl cpu_paged_kernel True" in again[0] and "compiling" not in again[1], again


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):  # noqa: F811
    work = tmp_path_factory.mktemp("cpu-attn")
    folder = tiny_model_with_tokenizer("llama", work / "m", smollm2_dir, vocab_size=49152)
    s = start_server(work, str(folder), "--served-model-name", "tiny", "--max-model-len", "256",
                     "--additional-config", '{"rl_config": {"enabled": true}}')  # RL mode: /server_info
    yield s
    s.stop()


def test_server_info_names_the_attention_kernel_and_it_serves(server) -> None:
    workers = httpx.get(server.url + "/server_info", timeout=30).json()["workers"]
    assert [w["attention"] for w in workers.values()] == ["cpu_paged_kernel"]
    threads = next(iter(workers.values()))["cpu_threads"]
    assert threads["kernels"] == threads["torch"] >= 1, threads  # the kernels' loops on all of torch's threads
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 8,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_serve_refuses_an_unknown_cpu_attention(tmp_path, smollm2_dir) -> None:  # noqa: F811
    folder = tiny_model_with_tokenizer("llama", tmp_path / "m", smollm2_dir, vocab_size=49152)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(folder), "--port",
                        str(free_port())], env={**os.environ, "ROLLBUS_CPU_ATTENTION": "fast"},
                       capture_output=True, text=True, timeout=180)
    assert r.returncode != 0 and "ROLLBUS_CPU_ATTENTION must be one of kernel, torch, got 'fast'" in r.stderr + r.stdout


@pytest.mark.slow  # compiles the variant once (~20-60 s)
@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_the_narrower_code_paths_give_the_same_results(tmp_path, variant) -> None:
    """The plain C++ path that CPUs without AVX2/FMA get, and the AVX2 path of CPUs without AVX-512, built
    here on purpose, pass the same checks."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "matches_sdpa or same_bits or refused_with"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT), cpu_kernels.ENABLE_ENV: variant})
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "failed" not in r.stdout


@pytest.mark.parametrize("hq, hk, ctx, rows", [(9, 3, 300, 300), (9, 3, 300, 77), (8, 8, 129, 40), (6, 1, 200, 200),
                                                (9, 3, 1500, attention.SPLIT_CHUNK_ROWS)])
def test_a_long_fp32_prefill_is_causal_attention(hq, hk, ctx, rows) -> None:
    """A whole prompt (is_causal), a chunk after earlier context (the lower-right causal bias) and a chunk of
    SPLIT_CHUNK_ROWS rows or more after it (the earlier keys and the chunk's own attended apart, merged) through
    torch's flash attention: row i of the chunk sees the keys up to position ctx - rows + i, as the fp64
    reference computes it."""
    g = torch.Generator().manual_seed(ctx + rows)
    q, k, v = (torch.randn(h, n, 64, generator=g) for h, n in ((hq, rows), (hk, ctx), (hk, ctx)))
    got = attention._causal_flash(q, k, v, 0.125)
    kr, vr = k.double().repeat_interleave(hq // hk, 0), v.double().repeat_interleave(hq // hk, 0)
    s = torch.einsum("hqd,hkd->hqk", q.double(), kr) * 0.125
    s.masked_fill_(torch.arange(ctx)[None, :] > torch.arange(ctx - rows, ctx)[:, None], float("-inf"))
    assert rel_err(got, torch.einsum("hqk,hkd->hqd", s.softmax(-1), vr)) < 1e-5


def test_a_prefill_chunk_after_context_is_torchs_lower_right_bias_without_importing_dynamo() -> None:
    """The chunk's mask is the boolean tensor torch.nn.attention.bias.causal_lower_right turns into on CPU, so
    the output is the same bit for bit; and computing it does not import torch._dynamo (that module's import took
    0.7-1.6 s of the first served prompt that hit the prefix cache)."""
    code = ("import sys, torch; from ascend_ops import attention\n"
            "g = torch.Generator().manual_seed(3)\n"
            "q, k, v = torch.randn(9, 40, 64, generator=g), torch.randn(3, 90, 64, generator=g), "
            "torch.randn(3, 90, 64, generator=g)\n"
            "got = attention._causal_flash(q, k, v, 0.125)\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
            "from torch.nn.attention.bias import causal_lower_right\n"
            "ref = torch.nn.functional.scaled_dot_product_attention(q[None], k.repeat_interleave(3, 0)[None], "
            "v.repeat_interleave(3, 0)[None], attn_mask=causal_lower_right(40, 90), scale=0.125)[0]\n"
            "print('equal' if torch.equal(got, ref) else 'differ')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split() == ["no", "dynamo", "equal"], r.stdout + r.stderr[-2000:]
