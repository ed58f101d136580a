"""What a JSON-schema constraint costs: N concurrent chat requests with `response_format` json_schema
against the very same requests unconstrained, on one server, in one run. Rounds alternate (plain,
constrained, constrained, plain, ...) so drift on a shared machine hits both sides alike. The schema has a
long string field (minLength above what max_tokens can reach), so a constrained request runs its whole
max_tokens like the plain one (`ignore_eos`): both sides generate the same number of tokens and the
throughput ratio is the mask's cost. The bar (issue 14) is a ratio >= 0.90.

    python bench/structured_outputs.py                       # SmolLM2, 64 x 64 tokens, 2 rounds a side
    python bench/structured_outputs.py --requests 64 --max-tokens 128 --rounds 3 --json out.json

Prints, per side, the best and median useful tokens/s, then best-vs-best and median-vs-median ratios and
the load average (`os.getloadavg`), since the machine may be shared.

`--in-process` measures the same batch without a server: the worker's ModelRunner decodes N sequences with
the schema against N without it (alternating rounds, seeded), and prints the median step time of each side,
wall and CPU (the step's own thread: stable on a shared machine with `--threads 1`), their ratio, and the
grammar's share in the step's thread (mask fill: starting it and waiting for it, since it runs beside the
model on the grammar thread; sampling; matcher advance):

    python bench/structured_outputs.py --in-process --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from tests.serve_process import start_server  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "body"],
          "properties": {"title": {"type": "string", "maxLength": 8},
                         "body": {"type": "string", "minLength": 4000}}}


async def _one(h: httpx.AsyncClient, i: int, max_tokens: int, constrained: bool) -> int:
    body = {"messages": [{"role": "user", "content": f"Write note number {i} as JSON."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": i, "ignore_eos": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}
    r = await h.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    if constrained:
        assert out["choices"][0]["message"]["content"].startswith('{"title"') or \
            out["choices"][0]["message"]["content"].lstrip().startswith("{"), out
    return out["usage"]["completion_tokens"]


async def _round(url: str, n: int, max_tokens: int, constrained: bool) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as h:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(_one(h, i, max_tokens, constrained) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - t0)


class _Clock:
    """Wall and CPU seconds spent in the wrapped functions (the step's thread only)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.thread_time() - t0

        return timed


PIECES = ("model", "LM head", "step prep", "mask fill", "sampling", "matcher advance")
GRAMMAR = ("mask fill", "sampling", "matcher advance")  # what a constraint adds to (sampling: changes in)


def _in_process_side(model, folder: Path, a, constrained: bool, clock: _Clock) -> dict[str, float]:
    """One round: N seeded sequences prefilled, then max_tokens decode steps; median seconds per step."""
    import workers.model_runner as mr
    from bus.messages import NewSeq, StepPlan
    from bus.sampling_params import SamplingParams, StructuredOutputsParams
    from engine.structured_outputs import StructuredOutputsConfig
    from workers.kv_cache import KVCache

    n, bs = a.requests, 16
    per_seq = (a.prompt_tokens + a.max_tokens + bs) // bs
    kv = KVCache(*model.kv_spec, bs, n * per_seq + 1, torch.float32, torch.device("cpu"))
    runner = mr.ModelRunner(model, kv, rank=0, block_size=bs, device=torch.device("cpu"),
                            tokenizer_path=folder / "tokenizer.json",
                            structured_outputs=StructuredOutputsConfig(disable_any_whitespace=True))
    runner.grammar.step_masks = clock.wrap("mask fill", runner.grammar.step_masks)  # starts it
    runner.grammar.advance = clock.wrap("matcher advance", runner.grammar.advance)
    runner._prepare = clock.wrap("step prep", runner._prepare)
    so = StructuredOutputsParams(json=json.dumps(SCHEMA)) if constrained else None
    ids = [f"s{i}" for i in range(n)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (a.prompt_tokens,), generator=g).tolist() for _ in ids]
    new = [NewSeq(s, p, SamplingParams(temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=i,
                                       structured_outputs=so), [2]) for i, (s, p) in enumerate(zip(ids, prompts))]
    runner.execute(StepPlan(0, new, ids, [0] * n, [len(p) for p in prompts], tables, [], 0))
    steps: dict[str, list[float]] = defaultdict(list)
    for k in range(1, a.max_tokens):
        clock.spent.clear()
        computed = [len(runner.seqs[s].tokens) - 1 for s in ids]
        w0, c0 = time.perf_counter(), time.thread_time()
        res = runner.execute(StepPlan(k, [], ids, computed, [1] * n, tables, [], 0))
        steps["wall"].append(time.perf_counter() - w0)
        steps["cpu"].append(time.thread_time() - c0)
        assert not res.seq_errors, res.seq_errors
        for name in PIECES:
            steps[name].append(clock.spent.get(name, 0.0))
    if constrained:  # the constraint held: every output is a prefix of the schema's JSON
        text = runner.grammar._tok.decode_str(runner.seqs[ids[0]].row.output_token_ids)
        assert text.startswith('{"title":"'), text
    return {name: statistics.median(v) for name, v in steps.items()}


def in_process(a) -> dict:
    import workers.model_runner as mr
    from tests.tiny_models import load_model
    from workers.grammar import PendingMasks

    if a.threads:
        torch.set_num_threads(a.threads)
    folder = resolve_model(a.model, progress=False)
    model = load_model(folder)
    clock = _Clock()
    mr.sample = clock.wrap("sampling", mr.sample)
    PendingMasks.result = clock.wrap("mask fill", PendingMasks.result)  # waits for it (if still running)
    model.forward = clock.wrap("model", model.forward)  # the layers (nn.Module.__call__ calls the instance's)
    model.lm_head_product = clock.wrap("LM head", model.lm_head_product)  # the runner's LM head calls
    model.logits_from = clock.wrap("LM head", model.logits_from)
    sides: dict[str, list[dict[str, float]]] = {"plain": [], "json_schema": []}
    for side in (["plain", "json_schema", "json_schema", "plain"] * a.rounds)[:2 * a.rounds]:
        sides[side].append(_in_process_side(model, folder, a, side == "json_schema", clock))
    best = {side: {k: min(r[k] for r in rounds) for k in rounds[0]} for side, rounds in sides.items()}
    print(f"in process: {a.requests} sequences, {a.max_tokens} decode steps, {torch.get_num_threads()} threads, "
          f"best round's median per step (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for side, b in best.items():
        print(f"  {side:12s} " + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in b.items()))
    out = {"requests": a.requests, "max_tokens": a.max_tokens, "threads": torch.get_num_threads(), "sides": best,
           "ratio_wall": best["json_schema"]["wall"] / best["plain"]["wall"],
           "ratio_cpu": best["json_schema"]["cpu"] / best["plain"]["cpu"], "loadavg": os.getloadavg()}
    # the pieces a constraint changes, against the plain step: the part of the ratio that is not load noise
    extra = sum(best["json_schema"][k] - best["plain"][k] for k in GRAMMAR)
    out["grammar_ms_per_step"] = extra * 1e3
    out["ratio_grammar"] = (best["plain"]["cpu"] + extra) / best["plain"]["cpu"]
    print(f"json_schema / plain step time: wall {out['ratio_wall']:.3f}, cpu {out['ratio_cpu']:.3f}; the grammar's "
          f"pieces add {extra * 1e3:.2f} ms per step: plain cpu step + that = {out['ratio_grammar']:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per side")
    ap.add_argument("--json", default=None, help="write the numbers here too")
    ap.add_argument("--in-process", action="store_true", help="no server: the worker's ModelRunner, step times")
    ap.add_argument("--prompt-tokens", type=int, default=40, help="--in-process: random prompt ids per sequence")
    ap.add_argument("--threads", type=int, default=0, help="--in-process: torch threads (default: torch's own)")
    a = ap.parse_args()
    if a.in_process:
        out = in_process(a)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2))
        return
    folder = resolve_model(a.model, progress=False)
    with tempfile.TemporaryDirectory(prefix="bench-so-") as work:
        s = start_server(Path(work), str(folder), "--max-num-seqs", str(max(a.requests, 1)), "--max-model-len",
                         "1024", "--structured-outputs-config", '{"disable_any_whitespace": true}')
        try:
            # warm both paths with the measured batch (prompts in the prefix cache, the grammar compiled), so
            # the first measured round pays for neither
            asyncio.run(_round(s.url, a.requests, 4, True))
            asyncio.run(_round(s.url, a.requests, 4, False))
            sides: dict[str, list[float]] = {"plain": [], "json_schema": []}
            order = ["plain", "json_schema", "json_schema", "plain"] * a.rounds
            for side in order[:2 * a.rounds]:
                tps = asyncio.run(_round(s.url, a.requests, a.max_tokens, side == "json_schema"))
                sides[side].append(tps)
                print(f"{side:12s} {tps:8.1f} tokens/s", file=sys.stderr, flush=True)
        finally:
            s.stop()
    best = {k: max(v) for k, v in sides.items()}
    med = {k: statistics.median(v) for k, v in sides.items()}
    out = {"requests": a.requests, "max_tokens": a.max_tokens, "tokens_per_s": sides,
           "ratio_best": best["json_schema"] / best["plain"], "ratio_median": med["json_schema"] / med["plain"],
           "loadavg": os.getloadavg()}
    print(f"json_schema / plain throughput: best {out['ratio_best']:.3f}, median {out['ratio_median']:.3f} "
          f"(bar >= 0.90; load average {out['loadavg'][0]:.1f} on {os.cpu_count()} CPUs)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
