"""Where one decode step's time goes, in process (no server, no sockets): the worker's ModelRunner on
SmolLM2-135M (fp32 by default) with S sequences at ~C tokens of context, decoding together.

Every kernel the model calls (ascend_ops Kernels: linear, rms_norm and add_rms_norm (which includes the
residual add before the norm), apply_rope, silu_and_mul, paged_attention), the LM head, the sampler and
the runner's step preparation are wrapped in a timer that counts its own time (a nested call's time goes
to the inner one; the LM head's GEMM counts as LM head).
Whatever is left of the step's wall time is "other": the embedding lookup, rope table gathers, residual
adds, q/k/v views and the Python between the ops. Fractions are printed so that load from other
processes matters less; on a shared machine compare runs by their fractions or ratios, never by ms.

  python bench/step_profile.py                      # 64 x ~100 tokens, 12 timed steps
  python bench/step_profile.py --seqs 256 --ctx 200 --steps 6
  python bench/step_profile.py --shape qwen3-0.6b --threads 1   # Qwen3-0.6B's shape, dummy weights
  python bench/step_profile.py --plain              # no timers: the bare step time (timer overhead check)
  python bench/step_profile.py --logprobs 1 --dump /tmp/a.npy   # outputs, to compare two checkouts bitwise
  python bench/step_profile.py --attention both     # CPU attention: the in-place kernel, then torch SDPA,
                                                    # in one process, with the kernel/torch ratios
  python bench/step_profile.py --mla-vs-mha --seqs 64 --ctx 512 --steps 4 --threads 1
      # DeepSeek-V3's attention (MLA over its latent cache, absorbed) against MHA on the same model's
      # shape (MLA_SHAPE, --load-format dummy weights): attention ms per step and KV bytes per token

A/B against another checkout: run it with PYTHONPATH pointing at each tree in turn (the script imports
whatever `ascend_ops` / `workers` come first on the path).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's bench/

import workers.model_runner as mr  # noqa: E402
import workers.sampler as sampler  # noqa: E402
from ascend_ops import attention  # noqa: E402
from ascend_ops.batch_invariant import DEFAULT  # noqa: E402
from ascend_ops.platform import tune_host_allocator  # noqa: E402
from bench.model_shapes import SHAPES  # noqa: E402
from bus.messages import NewSeq, StepPlan  # noqa: E402
from bus.sampling_params import SamplingParams  # noqa: E402
from engine.config import KV_CACHE_DTYPES  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from workers.kv_cache import KVCache, cache_dtype  # noqa: E402
from workers.loader import initialize_dummy_weights  # noqa: E402
from workers.models.checkpoint import iter_checkpoint, load_hf_config  # noqa: E402
from workers.models.registry import build_model  # noqa: E402

KERNEL_CLASSES = {"linear": "GEMM (layers)", "paged_attention": "attention (paged)", "rms_norm": "rms_norm",
                  "add_rms_norm": "rms_norm", "apply_rope": "rotary", "silu_and_mul": "silu*mul",
                  "head_linear": "MLA absorb (per head)"}
ORDER = ["GEMM (layers)", "LM head", "attention (paged)", "MLA absorb (per head)", "rms_norm", "rotary", "silu*mul",
         "sampling", "step prep (runner)", "other (embed, adds, Python)"]
# DeepSeek-V3's attention shapes (16 of its 128 heads, 2 small dense layers, a 32k vocabulary) for --mla-vs-mha; its MHA
# twin keeps hidden size, heads and layers, with K and V heads of the query's qk_head_dim (192)
MLA_SHAPE = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
             "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
             "q_lora_rank": 768, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
             "v_head_dim": 128, "first_k_dense_replace": 2, "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
MHA_TWIN = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 1024,
            "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 192,
            "max_position_embeddings": 4096, "rope_theta": 10000.0}


class Timers:
    """Self time per class; a call nested in another charges its time to itself, not to the outer one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [class, start, time spent in children]
        self.on = True

    def wrap(self, cls: str, fn, inherit: str | None = None):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            # a GEMM inside the LM head is the LM head's
            name = inherit if inherit and self.stack and self.stack[-1][0] == inherit else cls
            frame = [name, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter() - frame[1]
                self.total[name] += spent - frame[2]
                if self.stack:
                    self.stack[-1][2] += spent

        return timed


def build(args, timers: Timers | None):
    tune_host_allocator()  # as a CPU worker does at start (ascend_ops.platform)
    folder = resolve_model(None, progress=False)
    kern = DEFAULT
    if timers is not None:
        kern = dataclasses.replace(DEFAULT, **{k: timers.wrap(c, getattr(DEFAULT, k), inherit="LM head" if
                                                              k == "linear" else None)
                                               for k, c in KERNEL_CLASSES.items() if getattr(DEFAULT, k, None)})
    dtype = getattr(torch, args.dtype)
    if args.hf_config is not None:  # --shape, --mla-vs-mha: a shape, with --load-format dummy's weights
        model = build_model(args.hf_config, dtype, "cpu", kernels=kern)
        initialize_dummy_weights(model)
    else:
        model = build_model(load_hf_config(folder), dtype, "cpu", kernels=kern)
        model.load_weights(iter_checkpoint(folder))
    bs = 16
    per_seq = (args.ctx + args.steps + args.warmup + 2 + bs - 1) // bs
    kv = KVCache.for_model(model, bs, args.seqs * per_seq + 1, cache_dtype(args.kv_cache_dtype, dtype),
                           torch.device("cpu"))
    runner = mr.ModelRunner(model, kv, rank=0, block_size=bs, device=torch.device("cpu"))
    if timers is not None:
        model.lm_head_product = timers.wrap("LM head", model.lm_head_product)  # the runner's LM head calls
        model.logits_from = timers.wrap("LM head", model.logits_from)
        sampler.sample = timers.wrap("sampling", sampler.sample)  # sample_in_spans calls it per span
        runner._prepare = timers.wrap("step prep (runner)", runner._prepare)
    return runner, per_seq


def run(args) -> tuple[float, float]:
    """Prints the profile; returns (median step s, median attention s) of the timed steps."""
    timers = None if args.plain else Timers()
    runner, per_seq = build(args, timers)
    torch.manual_seed(0)
    sp = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True, logprobs=args.logprobs)
    ids = [f"s{i}" for i in range(args.seqs)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(args.seqs)]
    vocab = runner.model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (args.ctx - i % 8,)).tolist() for i in range(args.seqs)]  # ~ctx, ragged
    step = 0
    if timers:
        timers.on = False
    for a in range(0, args.seqs, 8):  # prefill 8 prompts a step
        new = [NewSeq(s, p, sp, [0]) for s, p in zip(ids[a:a + 8], prompts[a:a + 8])]
        step += 1
        runner.execute(StepPlan(step, new, ids[a:a + 8], [0] * len(new), [len(p) for p in prompts[a:a + 8]],
                                tables[a:a + 8], [], 0))
    walls, per_class, dumped = [], defaultdict(list), []
    for i in range(args.warmup + args.steps):
        computed = [len(runner.seqs[s].tokens) - 1 for s in ids]
        step += 1
        plan = StepPlan(step, [], ids, computed, [1] * args.seqs, tables, [], 0)
        if timers:
            timers.total.clear()
            timers.on = i >= args.warmup
        t0 = time.perf_counter()
        res = runner.execute(plan)
        wall = time.perf_counter() - t0
        dumped.append(np.stack([res.token_ids.astype(np.float64), res.logprobs.astype(np.float64)]))
        if i >= args.warmup:
            walls.append(wall)
            if timers:
                for c in ORDER[:-1]:
                    per_class[c].append(timers.total.get(c, 0.0))
                per_class[ORDER[-1]].append(wall - sum(timers.total.values()))
    if args.dump:
        np.save(args.dump, np.stack(dumped))
    med = statistics.median(walls)
    ctx = statistics.mean(len(runner.seqs[s].tokens) for s in ids)
    name = runner.model.cfg.architecture + " (dummy weights)" if args.hf_config else "SmolLM2-135M"
    print(f"{name} {args.dtype} (KV cache {args.kv_cache_dtype}), {args.seqs} sequences decoding at "
          f"~{ctx:.0f} tokens of context, "
          f"{args.steps} steps (after {args.warmup} warm-up), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, attention {attention.implementation('cpu')}")
    print(f"step wall time: median {med * 1e3:.1f} ms (min {min(walls) * 1e3:.1f}, max {max(walls) * 1e3:.1f}); "
          f"{args.seqs / med:.0f} tok/s")
    if not timers:
        return med, float("nan")
    print(f"\n| {'class':<30} | median ms | fraction of step |")
    print(f"|{'-' * 32}|-----------|------------------|")
    for c in ORDER:
        ms = statistics.median(per_class[c]) * 1e3
        frac = statistics.median(v / w for v, w in zip(per_class[c], walls))
        print(f"| {c:<30} | {ms:9.1f} | {frac:15.1%} |")
    return med, statistics.median(a + b for a, b in zip(per_class["attention (paged)"],
                                                       per_class["MLA absorb (per head)"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--ctx", type=int, default=100, help="prompt tokens per sequence (ragged: ctx-7 .. ctx)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype, as rollbus serve's flag (auto: the model's)")
    p.add_argument("--logprobs", type=int, default=None, help="ask every row for this many logprobs")
    p.add_argument("--dump", default=None, help="save every step's sampled ids and logprobs here (.npy), to "
                   "compare two checkouts' outputs bitwise")
    p.add_argument("--plain", action="store_true", help="no timers: only the step wall time")
    p.add_argument("--attention", default="kernel", choices=["kernel", "torch", "both"],
                   help="CPU paged attention: the in-place C++ kernel (the default), the torch SDPA path, or both "
                        "in turn in this process (same model, same steps) with the kernel/torch ratios")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default: torch's own). 1 gives stable fractions on a loaded machine: "
                        "with 2+ threads every small op waits at a barrier for a thread another process preempted")
    p.add_argument("--shape", default="smollm2", choices=["smollm2", *SHAPES],
                   help="smollm2: the real SmolLM2-135M; a Qwen3 shape (bench/model_shapes.py): its config with "
                        "--load-format dummy's random weights")
    p.add_argument("--mla-vs-mha", action="store_true",
                   help="MLA_SHAPE's latent attention, then its MHA twin (dummy weights): attention ms and KV bytes")
    args = p.parse_args()
    args.hf_config = None if args.shape == "smollm2" else SHAPES[args.shape]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mla_vs_mha:
        mla_vs_mha(args)
        return
    got = {}
    for choice in ("kernel", "torch") if args.attention == "both" else (args.attention,):
        if attention.select(choice) != choice:
            raise SystemExit(f"--attention {choice}: not available here ({attention.cpu_kernels.unavailable()})")
        got[choice] = run(args)
        print()
    if len(got) == 2:
        (ks, ka), (ts, ta) = got["kernel"], got["torch"]
        print(f"kernel / torch, same process: step {ks * 1e3:.1f} / {ts * 1e3:.1f} ms = {ks / ts:.2f}; "
              f"attention {ka * 1e3:.1f} / {ta * 1e3:.1f} ms = {ka / ta:.2f}")


def mla_vs_mha(args) -> None:
    """Attention (paged attention plus MLA's per-head absorbed products) per decode step, and KV cache bytes per
    token, of MLA_SHAPE and of MHA_TWIN, in this process."""
    got = {}
    for name, cfg in (("MLA", MLA_SHAPE), ("MHA", MHA_TWIN)):
        args.hf_config = cfg
        got[name] = run(args)
        model = build_model(cfg, getattr(torch, args.dtype), "meta")
        per_token = KVCache.bytes_per_block(*model.kv_spec, 1, getattr(torch, args.dtype), model.kv_planes)
        got[name] += (per_token,)
        print(f"{name}: KV cache {per_token} bytes per token ({model.kv_spec.num_layers} layers)\n")
    (ms, ma, mb), (hs, ha, hb) = got["MLA"], got["MHA"]
    print(f"MLA / MHA: attention {ma * 1e3:.1f} / {ha * 1e3:.1f} ms per step = {ma / ha:.2f}; step {ms * 1e3:.1f} / "
          f"{hs * 1e3:.1f} ms; KV bytes per token {mb} / {hb} = 1/{hb / mb:.1f}")


if __name__ == "__main__":
    main()
