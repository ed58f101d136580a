"""Colocated RLHF over HTTP: the engine sleeps while the trainer trains, then takes the new weights by IPC.

Trainer and engine share one device (here the CPU): generate -> /sleep (the engine frees its KV cache,
and at level 2 its weights, for the trainer) -> train -> /wake_up?tags=weights -> IPC transfer (shared
memory on CPU, CUDA/NPU IPC handles on accelerators; no pickle) -> /wake_up?tags=kv_cache -> generate.
Mirrors vLLM-Ascend's examples/rl/rlhf_http_npu_ipc.py plus the sleep/wake recipe of vLLM's RL docs.

Start the server first (the default model, SmolLM2-135M-Instruct, in fp32 on CPU):

    rollbus serve --additional-config '{"rl_config": {"enabled": true}}' --enable-sleep-mode \\
                  --weight-transfer-config '{"backend": "ipc"}'

then `python examples/rlhf_http_ipc.py` (--level 2 to discard the weights too; --url if the server is not
on port 8000). Each of two rounds prints the bytes /sleep released, trains three AdamW steps on a fixed
text, pushes the weights as version step-3 / step-6 (pause=None: the engine is asleep, nothing runs),
wakes the KV cache, and checks the engine's greedy logprobs against the trainer's (within 1e-4) and
every tensor bitwise with /weight_checker. Expected (numbers vary a little):

    rollout under 'default': 'Rollbus pushes the ball 100 feet up, but the ball'
    round 1: /sleep?level=1 released 1073.5 MB
      train step 1/3: loss 7.0642
      ...
      /wake_up?tags=weights -> sleeping; pushed step-3 (538.1 MB) in 1.87 s; /wake_up?tags=kv_cache -> awake
      rollout under 'step-3': 'Rollbus pushes a new batch of weights into a running engine, and the'
      token                engine    trainer     before
      ' a'               -1.87264   -1.87264   -2.07678
      ...
      max |engine - trainer| = 7.15e-06 (tolerance 0.0001); greedy agrees: True
      /weight_checker compare: match=True mismatches=[]
    round 2: /sleep?level=1 released 1611.5 MB
    ...
    OK: after sleep/train/wake the engine computes exactly what the trainer holds, version step-6

On CPU, level 1 frees the 1 GiB KV cache; from round 2 on also the staging copy of the weights (538 MB)
that the engine keeps after an update for the next one (engine/weights/receiver.py). Level 2 frees the
weights themselves too (538 MB more: 2149.6 MB once a staging copy exists).

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


def post(url: str, path: str) -> dict:
    r = httpx.post(url + path, timeout=120)
    r.raise_for_status()
    return r.json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the rollbus server")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1,
                    help="sleep level: 1 frees the KV cache (and offloads weights on accelerators), 2 discards "
                         "the weights too (they hold garbage until the transfer)")
    ap.add_argument("--rounds", type=int, default=2, help="sleep -> train -> push -> wake rounds")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per round")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    args = ap.parse_args()
    url = args.url

    model, tok = load_trainer()
    prompt, text = encode(tok, PROMPT), encode(tok, TEXT)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"rollout under {weight_version(url)!r}: {tok.decode(prompt + engine_greedy(url, prompt, 12)[0])!r}")

    ok = True
    # one client for every round: its shared-memory buffers are reused from version to version
    with WeightSyncClient(url, backend="ipc", packed=True) as client:
        for r in range(1, args.rounds + 1):
            version = f"step-{r * args.steps}"
            slept = post(url, f"/sleep?level={args.level}")  # mode=abort: running requests end now
            print(f"round {r}: /sleep?level={args.level} released {slept['released_bytes'] / 1e6:.1f} MB")
            before = train(model, text, args.steps, args.lr)
            woke = post(url, "/wake_up?tags=weights")
            # pause=None: the engine sleeps, nothing is scheduled; the update itself holds the scheduler too
            t = client.send_weights(model.named_parameters(), version=version, pause=None)
            awake = post(url, "/wake_up?tags=kv_cache")
            print(f"  /wake_up?tags=weights -> {woke['status']}; pushed {version} ({nbytes / 1e6:.1f} MB) in "
                  f"{t['total']:.2f} s; /wake_up?tags=kv_cache -> {awake['status']}")
            ok &= awake["status"] == "awake" and weight_version(url) == version
            print(f"  rollout under {weight_version(url)!r}: "
                  f"{tok.decode(prompt + engine_greedy(url, prompt, 12)[0])!r}")
            ok &= check_logprobs(url, model, before, tok, prompt)
            ok &= engine_matches_bitwise(url, model)
            del before

    if not ok:
        print("MISMATCH: the engine does not compute what the trainer holds")
        return 1
    print(f"OK: after sleep/train/wake the engine computes exactly what the trainer holds, version "
          f"{weight_version(url)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
