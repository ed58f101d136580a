"""Cross-device RLHF over HTTP: train, push the new weights with a collective broadcast, check the engine.

The trainer (Hugging Face transformers, in this process) and the engine hold separate copies of the
weights; the trainer joins a broadcast group as rank 0 with the engine's workers (HCCL on Ascend, NCCL on
CUDA, Gloo on CPU) and pushes every parameter in packed chunks. Mirrors vLLM-Ascend's
examples/rl/rlhf_http_hccl.py, with the trainer client doing pause -> start -> update -> finish -> resume.

Start the server first (the default model, SmolLM2-135M-Instruct, in fp32 on CPU):

    rollbus serve --additional-config '{"rl_config": {"enabled": true}}' \\
                  --weight-transfer-config '{"backend": "hccl"}'

then `python examples/rlhf_http_collective.py` (--url if the server is not on port 8000). Each of two
rounds trains three AdamW steps on a fixed text, pushes the weights as version step-3 / step-6 with
pause=abort, prints the engine's greedy completion of the prompt with a table of logprobs (engine,
trainer, trainer before the round), checks they agree within 1e-4 and that /weight_checker finds every
tensor bitwise equal to the trainer's. Expected (numbers vary a little):

    engine workers: 1 -> broadcast group of 2 (trainer is rank 0)
    engine before any update ('default'): 'Rollbus pushes the ball 100 feet up, but the ball'
    round 1: 3 AdamW steps
      train step 1/3: loss 7.0642
      train step 2/3: loss 4.9546
      train step 3/3: loss 3.0196
      pushed step-3: 538.1 MB in 1.94 s (transfer 1.89 s); engine serves 'step-3'
      engine: 'Rollbus pushes a new batch of weights into a running engine, and the'
      token                engine    trainer     before
      ' a'               -1.87264   -1.87264   -2.07678
      ' new'             -1.83880   -1.83880   -6.94778
      ...
      max |engine - trainer| = 7.15e-06 (tolerance 0.0001); greedy agrees: True
      /weight_checker compare: match=True mismatches=[]
    round 2: 3 AdamW steps
      ...
      engine: 'Rollbus pushes new weights into a running engine, and every token says which'
      ...
    OK: the engine computes exactly what the trainer holds, version step-6

Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import httpx
from _common import (
    PROMPT,
    TEXT,
    WeightSyncClient,
    check_logprobs,
    encode,
    engine_greedy,
    engine_matches_bitwise,
    load_trainer,
    train,
    weight_version,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the rollbus server")
    ap.add_argument("--rounds", type=int, default=2, help="train -> push -> check rounds (one version each)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per round")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    args = ap.parse_args()

    model, tok = load_trainer()
    prompt, text = encode(tok, PROMPT), encode(tok, TEXT)
    world = httpx.get(f"{args.url}/get_world_size", timeout=30).json()["world_size"]
    print(f"engine workers: {world} -> broadcast group of {world + 1} (trainer is rank 0)")
    print(f"engine before any update ({weight_version(args.url)!r}): "
          f"{tok.decode(prompt + engine_greedy(args.url, prompt, 12)[0])!r}")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    ok = True
    # packed: parameters travel flattened into ~1 GiB chunks, two in flight (vLLM's packed broadcast)
    with WeightSyncClient(args.url, backend="hccl", packed=True) as client:
        for r in range(1, args.rounds + 1):
            version = f"step-{r * args.steps}"
            print(f"round {r}: {args.steps} AdamW steps")
            before = train(model, text, args.steps, args.lr)
            # abort: running requests end now (finish_reason "abort"); the group forms on the first call
            t = client.send_weights(model.named_parameters(), version=version, pause="abort")
            served = weight_version(args.url)
            print(f"  pushed {version}: {nbytes / 1e6:.1f} MB in {t['total']:.2f} s "
                  f"(transfer {t['transfer']:.2f} s); engine serves {served!r}")
            ok &= served == version
            print(f"  engine: {tok.decode(prompt + engine_greedy(args.url, prompt, 12)[0])!r}")
            ok &= check_logprobs(args.url, model, before, tok, prompt)
            ok &= engine_matches_bitwise(args.url, model)
            del before

    if not ok:
        print("MISMATCH: the engine does not compute what the trainer holds")
        return 1
    print(f"OK: the engine computes exactly what the trainer holds, version {weight_version(args.url)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
