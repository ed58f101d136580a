"""What the examples share: the trainer's model (exactly the weights `rollbus serve` loads), a few training
steps, and the check that the engine's logprobs equal the trainer's own.

The engine computes in fp32 (the default model's dtype), so the same weights give the same logprobs up
to summation order: within TOL. Greedy completions are asked for by token ids, so both sides see the
same tokens.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import httpx
import torch

try:
    import engine  # noqa: F401  (installed with `pip install -e .`)
except ImportError:  # run from a checkout without installing: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient, WeightSyncFailed, weight_checksums  # noqa: E402, F401

TOL = 1e-4  # fp32 logprobs, engine against trainer
PROMPT = "Rollbus pushes"
TEXT = "Rollbus pushes new weights into a running engine, and every token says which weights made it."


def load_trainer():
    """The served model in fp32 (the folder `rollbus serve` resolves when no model is given) and its
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model(None)
    print(f"trainer: loading {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def train(model: torch.nn.Module, text: list[int], steps: int = 3, lr: float = 1e-4) -> torch.nn.Module:
    """`steps` AdamW steps of language modelling on `text`; returns a copy of the model from before."""
    before = copy.deepcopy(model)
    text = torch.tensor([text])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        loss = model(text, labels=text).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"  train step {step + 1}/{steps}: loss {loss.item():.4f}")
    model.eval()
    return before


def engine_greedy(url: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The engine's greedy completion of `prompt`: token ids and their logprobs."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> tuple[list[float], list[float]]:
    """The model's logprob of each of `ids` after prompt + the ids before it, and its best logprob there."""
    rows = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float(), -1)
    return [rows[k, t].item() for k, t in enumerate(ids)], rows.max(-1).values.tolist()


def check_logprobs(url: str, model: torch.nn.Module, before: torch.nn.Module | None, tok, prompt: list[int],
                   n: int = 12) -> bool:
    """Greedy completion on the engine against the trainer's teacher-forced logprobs; prints a table."""
    ids, got = engine_greedy(url, prompt, n)
    want, best = teacher_forced(model, prompt, ids)
    old = teacher_forced(before, prompt, ids)[0] if before is not None else [float("nan")] * len(ids)
    print(f"  {'token':<16} {'engine':>10} {'trainer':>10} {'before':>10}")
    for t, g, w, o in zip(ids, got, want, old):
        print(f"  {tok.decode([t])!r:<16} {g:>10.5f} {w:>10.5f} {o:>10.5f}")
    diff = max(abs(g - w) for g, w in zip(got, want))
    # greedy: each engine token must also be a best token of the trainer's (up to TOL for near-ties)
    greedy_ok = all(b - w <= TOL for b, w in zip(best, want))
    print(f"  max |engine - trainer| = {diff:.2e} (tolerance {TOL:g}); greedy agrees: {greedy_ok}")
    return diff <= TOL and greedy_ok


def engine_matches_bitwise(url: str, model: torch.nn.Module) -> bool:
    """/weight_checker compare: the engine holds exactly the trainer's tensors (sha256 per tensor)."""
    r = httpx.post(f"{url}/weight_checker", timeout=300,
                   json={"action": "compare", "baseline": weight_checksums(model.named_parameters())})
    r.raise_for_status()
    body = r.json()
    print(f"  /weight_checker compare: match={body['match']} mismatches={body['mismatches'][:5]}")
    return body["match"]


def weight_version(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
