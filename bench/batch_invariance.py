"""Batch invariance, end to end over HTTP: every request run alone and inside a mixed batch must give the
same bits (tokens, logprobs, ranks, top-k, prompt logprobs, routed experts), and invariant mode's cost.

Each request is seeded sampling at temperature 1 with logprobs=5 and prompt_logprobs=5; half the prompts
share a 32-token prefix, so runs mix prefix-cache hits and misses. Compared, bit for bit (float32 bits):
  alone        each request by itself, one after the other (prefill budget 2048)
  mixed        all at once (prefill budget 2048)
  chunked      all at once, prefill budget 16 and a KV cache so small that requests are preempted
  recompute    each request's prompt + generated text sent back as a prompt: its prompt logprobs at the
               generated positions must equal the logprobs it was sampled with
Cost: the RL rollout workload of bench/rollout.py (64 prompts x 64 tokens, temperature 1) on a default
server and on an invariant one, measured in the same run.

    python bench/batch_invariance.py                                  # SmolLM2, fp32 and bf16
    python bench/batch_invariance.py --model moe --dtypes float32     # the MoE upcycled from SmolLM2
    python bench/batch_invariance.py --model qwen3-moe --skip-cost    # a small random Qwen3-MoE (QWEN3_MOE)
    python bench/batch_invariance.py --model qwen3-next --skip-cost   # a small random hybrid (QWEN3_NEXT)
    python bench/batch_invariance.py --num-requests 8 --max-tokens 16 --skip-cost   # quick
    python bench/batch_invariance.py --trainer-only     # use_engine_kernels: 16 rollouts x 64 tokens
    python bench/batch_invariance.py --cost-only --dtypes float32   # throughput, default vs invariant (ABBA)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server_helpers import metric, start_server  # noqa: E402

# --model qwen3-moe: random weights, SmolLM2's tokenizer; a dense layer among the sparse ones, 16 experts, top-4
QWEN3_MOE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                 num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                 mlp_only_layers=[1], norm_topk_prob=True, vocab_size=49152, max_position_embeddings=2048)
# --model qwen3-next: the tiny hybrid of tests/tiny_models.py (Gated DeltaNet, gated attention, MoE) at vocab 49152
QWEN3_NEXT = dict(vocab_size=49152, max_position_embeddings=2048)
INVARIANT_CONFIG = '{"rl_config": {"enabled": true, "enable_batch_invariant": true}}'


def make_requests(n: int, max_tokens: int, vocab: int, prompt_len: int = 40, shared: int = 32) -> list[dict]:
    """n generate bodies; the even ones share their first `shared` tokens and read the prefix cache (a
    request asking for prompt logprobs never does, as in vLLM); the odd ones ask for prompt logprobs."""
    prefix = [(97 * j + 13) % (vocab - 10) + 5 for j in range(shared)]
    out = []
    for i in range(n):
        own = [(31 * i + 7 * j + 3) % (vocab - 10) + 5 for j in range(prompt_len + i % 7)]
        prompt = (prefix + own[shared:]) if i % 2 == 0 else own
        out.append({"token_ids": prompt, "sampling_params": {
            "max_tokens": max_tokens, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True,
            "logprobs": 5, **({} if i % 2 == 0 else {"prompt_logprobs": 5})}})
    return out


def _f32(x: float | None) -> int | None:
    return None if x is None else struct.unpack("<I", struct.pack("<f", x))[0]


def normalise(body: dict) -> dict[str, Any]:
    """What must be bitwise equal, with every float as its float32 bits."""
    c = body["choices"][0]
    content = (c.get("logprobs") or {}).get("content") or []
    prompt = [None if p is None else sorted((int(t), _f32(v["logprob"]), v.get("rank")) for t, v in p.items())
              for p in body.get("prompt_logprobs") or []]
    return {
        "tokens": c["token_ids"],
        "logprobs": [_f32(e["logprob"]) for e in content],
        "ranks": [e.get("rank") for e in content],
        "top": [[(t["token_id"], _f32(t["logprob"])) for t in e["top_logprobs"]] for e in content],
        "prompt": prompt,
        "routed_experts": c.get("routed_experts"),
    }


async def _one(h: httpx.AsyncClient, body: dict) -> dict:
    r = await h.post("/inference/v1/generate", json=body)
    r.raise_for_status()
    return r.json()


async def run(url: str, bodies: list[dict], together: bool) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=httpx.Limits(max_connections=256)) as h:
        if together:
            raw = await asyncio.gather(*[_one(h, b) for b in bodies])
        else:
            raw = [await _one(h, b) for b in bodies]
    return list(raw)


def recompute_bodies(bodies: list[dict], results: list[dict]) -> list[dict]:
    """prompt + generated tokens (but the last) as a prompt, 1 token, prompt_logprobs=5."""
    return [{"token_ids": b["token_ids"] + r["choices"][0]["token_ids"][:-1],
             "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 5}}
            for b, r in zip(bodies, results)]


def diff(a: list[dict], b: list[dict]) -> list[str]:
    """Requests (by index) and fields whose bits differ."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        for key in x:
            if x[key] != y[key]:
                out.append(f"request {i}: {key}")
    return out


def recompute_diff(bodies: list[dict], results: list[dict], again: list[dict]) -> list[str]:
    """Each generated token's prompt logprob (and rank, top-5) in the recompute equals its sampled one."""
    out = []
    for i, (b, r, g) in enumerate(zip(bodies, results, again)):
        p = len(b["token_ids"])
        gen = normalise(r)
        prompt = normalise(g)["prompt"][p:]
        for j, entry in enumerate(prompt):  # the logprob of prompt token p + j, which is generated token j
            tok = gen["tokens"][j]
            chosen = [e for e in entry if e[0] == tok]
            # the generated entry lists the token, then the best alternatives: all among the prompt's top-5 + token
            if chosen != [(tok, gen["logprobs"][j], gen["ranks"][j])] or not \
                    set(gen["top"][j]) <= {(t, lp) for t, lp, _ in entry}:
                out.append(f"request {i}: position {p + j}")
                break
    return out


def check(url_wide: str, url_narrow: str, bodies: list[dict]) -> dict[str, list[str]]:
    """The four comparisons of the module docstring; each value lists what differed (empty = bitwise equal)."""
    def timed(name: str, url: str, b: list[dict], together: bool) -> list[dict]:
        t0 = time.perf_counter()
        out = asyncio.run(run(url, b, together))
        print(f"  {name}: {len(b)} requests in {time.perf_counter() - t0:.0f} s", flush=True)
        return out

    alone = timed("alone (one after the other)", url_wide, bodies, together=False)
    mixed = timed("mixed (all at once, reversed)", url_wide, list(reversed(bodies)), together=True)[::-1]
    chunked = timed("chunked + preempted (budget 16)", url_narrow, bodies, together=True)
    again = timed("recompute (prompt logprobs)", url_wide, recompute_bodies(bodies, alone), together=True)
    twice = timed("alone again", url_wide, bodies[:4], together=False)
    na = [normalise(r) for r in alone]
    return {"mixed": diff(na, [normalise(r) for r in mixed]),
            "chunked_preempted": diff(na, [normalise(r) for r in chunked]),
            "recompute": recompute_diff(bodies, alone, again),
            "alone_twice": diff(na, [normalise(r) for r in twice])}


def start_pair(work: Path, model: str, dtype: str, extra: tuple[str, ...] = (), max_model_len: int = 128):
    """An invariant server with room to spare (budget 2048), and one with budget 16 and a KV cache of one
    sequence and a half (so running requests are preempted and recomputed)."""
    num_blocks = max_model_len // 16 + max_model_len // 32
    common = ("--model", model, "--dtype", dtype, "--max-model-len", str(max_model_len), "--enable-scale-out",
              "--additional-config", INVARIANT_CONFIG, *extra)
    wide = start_server(work, *common, "--max-num-batched-tokens", "2048")
    try:
        narrow = start_server(work, *common, "--max-num-batched-tokens", "16",
                              "--num-gpu-blocks-override", str(num_blocks))
    except BaseException:
        wide.stop()
        raise
    return wide, narrow


def rollout_tok_s(work: Path, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                  invariant: bool) -> float:
    from bench.rollout import rollout

    extra = ("--additional-config", INVARIANT_CONFIG) if invariant else ()
    s = start_server(work, "--model", model, "--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs", "256",
                     *extra)
    try:
        name = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
        toks, dt = asyncio.run(rollout(s.url, name, prompts, 1, max_tokens))
        return toks / dt
    finally:
        s.stop()


def cost_abba(work: Path, model: str, dtype: str, tokenizer_dir: Path, max_tokens: int) -> dict[str, Any]:
    """Rollout throughput default, invariant, invariant, default; ratio = the invariant runs' mean over the
    default runs' mean (tok/s)."""
    from bench.rollout import make_prompts
    from gateway.tokenizer import Tokenizer

    prompts = make_prompts(Tokenizer.from_dir(tokenizer_dir), 64)
    order = (False, True, True, False)
    tok_s = [rollout_tok_s(work, model, dtype, prompts, max_tokens, invariant=inv) for inv in order]
    inv = [t for t, i in zip(tok_s, order) if i]
    base = [t for t, i in zip(tok_s, order) if not i]
    return {"order": ["invariant" if i else "default" for i in order], "tok_s": tok_s,
            "ratio": (sum(inv) / len(inv)) / (sum(base) / len(base))}


def trainer_check(folder: Path, dtype: str, rollouts: int = 16, max_tokens: int = 64) -> dict[str, Any]:
    """Trainer side: `rollouts` greedy rollouts from the engine's model (in process, invariant kernels, KV
    blocks of 16), then HF + use_engine_kernels on the right-padded batch: bitwise equal logprobs? And the
    cost of forward + backward against the plain HF model's, on the same batch, median of 3."""
    import statistics

    from transformers import AutoModelForCausalLM

    from ascend_ops.batch_invariant import INVARIANT
    from engine.trainer import use_engine_kernels
    from tests.tiny_models import PagedRunner
    from workers.models.checkpoint import iter_checkpoint, load_hf_config
    from workers.models.registry import build_model

    dt = getattr(torch, dtype)
    engine = build_model(load_hf_config(folder), dt, "cpu", kernels=INVARIANT)
    engine.load_weights(iter_checkpoint(folder))
    vocab = engine.cfg.vocab_size
    prompts = [b["token_ids"] for b in make_requests(rollouts, max_tokens, vocab)]
    runner = PagedRunner(engine, num_blocks=rollouts * ((max(map(len, prompts)) + max_tokens) // 16 + 2),
                         block_size=16)
    toks, logits = runner.greedy(dict(enumerate(prompts)), max_tokens)
    rows = [p + toks[i][:-1] for i, p in enumerate(prompts)]
    S = max(map(len, rows))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    out: dict[str, Any] = {}
    times: dict[str, list[float]] = {"plain": [], "engine_kernels": []}
    models = {"plain": AutoModelForCausalLM.from_pretrained(folder, dtype=dt),
              "engine_kernels": use_engine_kernels(AutoModelForCausalLM.from_pretrained(folder, dtype=dt))}
    for _ in range(3):
        for name, m in models.items():
            m.zero_grad()
            t0 = time.perf_counter()
            lp = torch.log_softmax(m(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            (-(lp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2) * mask[:, 1:]).sum()).backward()
            times[name].append(time.perf_counter() - t0)
            if name == "engine_kernels":
                equal = True
                for i, p in enumerate(prompts):
                    want = torch.log_softmax(logits[i].float(), -1).gather(1, torch.tensor(toks[i])[:, None])
                    got = lp[i, len(p) - 1:len(p) - 1 + max_tokens].gather(1, torch.tensor(toks[i])[:, None])
                    equal &= torch.equal(got.detach().view(torch.int32), want.view(torch.int32))
                out["bitwise_equal"] = bool(equal)
    med = {k: statistics.median(v) for k, v in times.items()}
    # gradients of the last iteration: the worst parameter's max |difference| relative to its max |gradient|
    plain = dict(models["plain"].named_parameters())
    out["grad_max_rel_diff"] = max(
        float((p.grad - plain[n].grad).abs().max() / plain[n].grad.abs().max().clamp_min(1e-30))
        for n, p in models["engine_kernels"].named_parameters() if plain[n].grad is not None)
    out.update({"fwd_bwd_s": med, "cost_ratio": med["engine_kernels"] / med["plain"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), moe (upcycled SmolLM2 MoE), qwen3-moe (QWEN3_MOE, random), qwen3-next "
                        "(QWEN3_NEXT, random) or a path")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-cost", action="store_true", help="Only the bitwise checks.")
    p.add_argument("--cost-only", action="store_true",
                   help="Only the cost: rollouts default, invariant, invariant, default (ABBA, so drift in the "
                        "machine's load cancels), 64 prompts x --max-tokens each.")
    p.add_argument("--trainer-only", action="store_true",
                   help="Only the trainer side: --rollouts x --max-tokens, bitwise and forward+backward cost.")
    p.add_argument("--rollouts", type=int, default=16, help="Trainer side: rollouts in the padded batch.")
    p.add_argument("--json", help="Write the results to this file.")
    args = p.parse_args()
    from engine.model_store import resolve_model
    from gateway.tokenizer import Tokenizer

    smol = resolve_model(None, progress=False)
    if args.model == "smollm2":
        folder = smol
    elif args.model == "moe":
        from tests.tiny_models import upcycled_smollm2_moe

        folder = upcycled_smollm2_moe(smol)
    elif args.model == "qwen3-moe":
        from tests.server_helpers import tiny_model_with_tokenizer

        folder = tiny_model_with_tokenizer("qwen3_moe", Path(tempfile.mkdtemp(prefix="rollbus-q3moe-")), smol,
                                           init_std=0.05, **QWEN3_MOE)
    elif args.model == "qwen3-next":
        from tests.server_helpers import tiny_model_with_tokenizer

        folder = tiny_model_with_tokenizer("qwen3_next", Path(tempfile.mkdtemp(prefix="rollbus-q3next-")), smol,
                                           **QWEN3_NEXT)
    else:
        folder = Path(args.model)
    hf = json.loads((Path(folder) / "config.json").read_text())
    vocab = hf["vocab_size"]
    moe = bool(hf.get("num_experts") or hf.get("num_local_experts"))
    extra = ("--enable-return-routed-experts",) if moe else ()
    results: dict[str, Any] = {"model": str(folder)}
    work = Path(tempfile.mkdtemp(prefix="rollbus-bi-"))
    if args.trainer_only:
        for dtype in args.dtypes:
            results[dtype] = r = trainer_check(Path(folder), dtype, args.rollouts, args.max_tokens)
            print(f"[{dtype}] trainer: logprobs bitwise equal to the engine's: {r['bitwise_equal']}; forward+"
                  f"backward {r['fwd_bwd_s']['engine_kernels']:.2f} s vs plain HF {r['fwd_bwd_s']['plain']:.2f} s "
                  f"(ratio {r['cost_ratio']:.2f}); gradients: max relative difference {r['grad_max_rel_diff']:.1e}",
                  flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    if args.cost_only:
        for dtype in args.dtypes:
            results[dtype] = r = cost_abba(work, str(folder), dtype, smol, args.max_tokens)
            print(f"[{dtype}] rollout 64x{args.max_tokens}, tok/s in order default/invariant/invariant/default: "
                  + ", ".join(f"{x:.1f}" for x in r["tok_s"]) + f"; invariant / default {r['ratio']:.3f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    for dtype in args.dtypes:
        bodies = make_requests(args.num_requests, args.max_tokens, vocab)
        t0 = time.perf_counter()
        need = 48 + args.max_tokens  # the longest prompt is 46 tokens
        wide, narrow = start_pair(work, str(folder), dtype, extra, max_model_len=-(-need // 64) * 64)
        try:
            res = check(wide.url, narrow.url, bodies)
            counts = {"preemptions": metric(narrow, "vllm:num_preemptions_total"),
                      "prefix_cache_hits": metric(wide, "vllm:prefix_cache_hits_total")}
        finally:
            wide.stop()
            narrow.stop()
        out = {"differences": res, "bitwise_equal": not any(res.values()), "seconds": time.perf_counter() - t0}
        print(f"[{dtype}] bitwise: " + ", ".join(f"{k}: {'equal' if not v else f'{len(v)} differ'}"
                                                 for k, v in res.items()), flush=True)
        if not args.skip_cost:
            from bench.rollout import make_prompts

            prompts = make_prompts(Tokenizer.from_dir(smol), 64)
            base = rollout_tok_s(work, str(folder), dtype, prompts, 64, invariant=False)
            inv = rollout_tok_s(work, str(folder), dtype, prompts, 64, invariant=True)
            out["rollout_tok_s"] = {"default": base, "invariant": inv, "ratio": inv / base}
            print(f"[{dtype}] rollout 64x64: default {base:.1f} tok/s, invariant {inv:.1f} tok/s, "
                  f"ratio {inv / base:.3f}", flush=True)
        out.update(counts)
        print(f"[{dtype}] preemptions (budget-16 server): {counts['preemptions']:.0f}, prefix-cache hit tokens "
              f"(wide server): {counts['prefix_cache_hits']:.0f}", flush=True)
        results[dtype] = out
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
