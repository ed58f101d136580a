"""GRPO-style steps with training consistency: the trainer's logprobs equal the engine's bit for bit, so the
importance ratio is exactly 1.0 for every sampled token, before and after each weight update.

Start the server first (the default model, SmolLM2-135M-Instruct, fp32 on CPU):

    rollbus serve --enable-scale-out --weight-transfer-config '{"backend": "ipc"}' \\
        --additional-config '{"rl_config": {"enabled": true, "enable_training_consistency": true}}'

then `python examples/grpo_consistency.py` (--url if the server is not on port 8000; --model PATH when the
server serves another folder; --dtype bfloat16 with a server started with --dtype bfloat16). Each step:
rollout (8 seeded samples of 16 tokens at temperature 1, by token ids) -> trainer forward on the
right-padded batch with engine.trainer.use_engine_kernels -> ratio exp(trainer - engine) for every token
(printed: all exactly 1.0) -> one SGD step on a GRPO loss (rewards: how many distinct tokens a sample
has, normalised per group) -> weight sync (IPC) -> the next rollout runs on the new weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import torch

try:
    import engine  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_ops.batch_invariant import attention_implementation  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient, use_engine_kernels  # noqa: E402

PROMPTS = [[1, 4093, 314, 253, 1345], [1, 4093, 3596, 702, 28]]  # token ids; 4 samples each


def rollout(url: str, step: int, max_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, sampled tokens, the engine's logprob of each) for 4 seeded samples per prompt."""
    out = []
    with httpx.Client(base_url=url, timeout=600) as h:
        for p, prompt in enumerate(PROMPTS):
            for s in range(4):
                r = h.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
                    "max_tokens": max_tokens, "temperature": 1.0, "seed": 100 * step + 10 * p + s,
                    "ignore_eos": True, "logprobs": 0}})
                r.raise_for_status()
                c = r.json()["choices"][0]
                out.append((prompt, c["token_ids"], [e["logprob"] for e in c["logprobs"]["content"]]))
    return out


def trainer_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logprob of every sampled token [B, T] (with autograd) and the mask of real tokens."""
    rows = [p + t[:-1] for p, t, _ in batch]
    S = max(map(len, rows))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):  # right padding: real tokens first
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)
    T = len(batch[0][1])
    out = torch.stack([lp[i, len(p) - 1:len(p) - 1 + T].gather(1, torch.tensor(t)[:, None]).squeeze(1)
                       for i, (p, t, _) in enumerate(batch)])
    return out, torch.ones_like(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="the folder the server serves (default: its default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    folder = resolve_model(args.model, progress=False)
    # the engine's invariant attention and this process's must be one implementation (the same bits)
    engine_attention = {w["attention"] for w in httpx.get(args.url + "/server_info", timeout=30).json()["workers"]
                        .values()}
    ours = attention_implementation("cpu", getattr(torch, args.dtype))
    if engine_attention != {ours}:
        raise SystemExit(f"the engine's workers run attention {sorted(engine_attention)}, this trainer {ours}: "
                         "give both processes the same ROLLBUS_CPU_ATTENTION")
    model = use_engine_kernels(AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    client = WeightSyncClient(args.url, backend="ipc")
    for step in range(args.steps):
        batch = rollout(args.url, step, args.max_tokens)
        engine_lp = torch.tensor([lps for _, _, lps in batch], dtype=torch.float32)
        lp, mask = trainer_logprobs(model, batch)
        ratio = torch.exp(lp - engine_lp)
        exact = bool((ratio.detach() == 1.0).all())
        print(f"step {step}: {ratio.numel()} tokens, ratio exactly 1.0 for every token: {exact} "
              f"(min {ratio.min().item():.9f}, max {ratio.max().item():.9f})")
        if not exact:
            raise SystemExit("the trainer's logprobs differ from the engine's")
        rewards = torch.tensor([float(len(set(t))) for _, t, _ in batch]).view(len(PROMPTS), -1)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        loss = -(ratio * adv * mask).sum() / mask.sum()  # GRPO's clipped term is ratio * adv at ratio 1
        opt.zero_grad()
        loss.backward()
        opt.step()
        client.send_weights(model.named_parameters(), version=f"step-{step + 1}", pause="keep")
        print(f"step {step}: loss {loss.item():.4f}; pushed weights step-{step + 1}")


if __name__ == "__main__":
    main()
