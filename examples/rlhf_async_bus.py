"""Async RL over the bus: new weights arrive in the middle of long streaming rollouts (pause=keep).

Rollouts stream from /v1/completions while the trainer trains; the trainer then announces the new
version on the bus (one WeightUpdateEvent; the coordinator drives pause=keep -> start -> IPC transfer ->
finish -> resume with every worker's ack) and the kept rollouts go on under the new weights. Each
rollout's last chunk carries `weight_versions`: half-open spans of its output tokens per version. Anyone
may subscribe to the committed versions (topic WEIGHTS_TOPIC on the bus's commands socket). Mirrors
vLLM-Ascend's examples/rl/rlhf_async_new_apis.py, whose check this repeats: the tokens after the switch
are what a fresh greedy continuation of prompt + tokens before the switch gives under the new weights.

Start the server first (the default model, SmolLM2-135M-Instruct, in fp32 on CPU; the default ipc bus):

    rollbus serve --additional-config '{"rl_config": {"enabled": true}}' \\
                  --weight-transfer-config '{"backend": "ipc"}'

then `python examples/rlhf_async_bus.py`. The bus is ipc:///tmp/rollbus-<uid>-<http port> by default
(--bus-dir moves it); with `--bus-transport tcp --bus-port-base 5550 --bus-curve-dir keys` pass
--bus tcp://127.0.0.1:5550 and set ROLLBUS_BUS_CURVE_DIR=keys (the client keys, see docs/serving.md).
Expected (token counts and numbers vary with the machine's speed):

    4 rollouts of 128 tokens streaming; training meanwhile
      train step 1/3: loss 7.0642
      ...
    pushing step-3 over the bus (pause=keep) with rollouts at [48, 49, 48, 48] tokens
      staged 1.02 s, sync 3.91 s; engine steps: pause 1.368 s, start_weight_update 0.017 s,
      update_weights 2.523 s, finish_weight_update 0.001 s, commit_weight_update 0.002 s, resume 0.001 s
    committed on the bus: version='step-3' weight_epoch=1
    rollout 0: tokens 0-53 default 54-127 step-3 | 'Rollbus pushes the ball 100 feet up, but the ball'...
    ...
    rollout 0: 74 tokens after the switch == fresh greedy continuation: True (logprobs max |diff| 3.0e-06);
      trainer's logprobs max |diff|: old weights 2.7e-05, new weights 5.5e-06
    ...
    OK: every rollout switched to step-3 mid-flight and continued exactly as the new weights would

Run it against a freshly started server: the trainer starts from the checkpoint, so must the engine.
Exits 1 if a rollout lacks either version or a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from urllib.parse import urlparse

import httpx
import zmq
from _common import PROMPT, TEXT, TOL, WeightSyncClient, encode, load_trainer, teacher_forced, train, weight_version

from bus.codec import decode
from bus.endpoints import WEIGHTS_TOPIC, Endpoints
from bus.messages import WeightVersionCommitted
from bus.sockets import make_socket

PROMPTS = [PROMPT, "Once upon a time, in a small village,", "The three laws of thermodynamics",
           "Here is a recipe for pancakes:"]


def rollout(url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """One greedy streaming completion; collects token ids, logprobs and (last chunk) weight_versions."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "return_token_ids": True, "return_weight_versions": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                out["ids"] += c["token_ids"]
                out["lps"] += c["logprobs"]["token_logprobs"]
                out["spans"] = c.get("weight_versions", out["spans"])
                out["finish"] = c["finish_reason"] or out["finish"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the rollbus server")
    ap.add_argument("--bus", default=None, help="the server's bus: ipc:///FOLDER (default: the server's default "
                    "folder for the --url port) or tcp://HOST:PORT_BASE (server with --bus-transport tcp)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per rollout")
    ap.add_argument("--switch-after", type=int, default=16, help="push once every rollout has this many tokens")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (AdamW, lr 1e-4)")
    args = ap.parse_args()
    url, version = args.url, f"step-{args.steps}"
    bus = args.bus or f"ipc://{tempfile.gettempdir()}/rollbus-{os.getuid()}-{urlparse(url).port or 80}"

    if weight_version(url) != "default":  # the trainer starts from the checkpoint: so must the engine
        print(f"the engine serves {weight_version(url)!r}, not the checkpoint: restart the server")
        return 1
    model, tok = load_trainer()
    # subscribe before anything commits: WeightVersionCommitted is published once per committed update
    ctx = zmq.Context()
    ep = Endpoints.from_url(bus).secure(ctx)  # tcp: the client keys from ROLLBUS_BUS_CURVE_DIR
    sub = make_socket(ctx, zmq.SUB, connect=ep.commands)
    sub.setsockopt(zmq.SUBSCRIBE, WEIGHTS_TOPIC)

    prompts = [encode(tok, p) for p in PROMPTS]
    outs = [{"ids": [], "lps": [], "spans": [], "finish": None} for _ in prompts]
    threads = [threading.Thread(target=rollout, args=(url, p, args.max_tokens, o), daemon=True)
               for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    print(f"{len(prompts)} rollouts of {args.max_tokens} tokens streaming; training meanwhile")
    before = train(model, encode(tok, TEXT), args.steps)
    while min(len(o["ids"]) for o in outs) < args.switch_after and all(t.is_alive() for t in threads):
        time.sleep(0.05)
    if not all(t.is_alive() for t in threads):
        print("a rollout finished before the push: raise --max-tokens")
        return 1

    print(f"pushing {version} over the bus (pause=keep) with rollouts at {[len(o['ids']) for o in outs]} tokens")
    # keep: running requests freeze and continue after the update; clear_cache (the client's default)
    # makes them drop their KV and recompute it under the new weights, so no later token sees old KV
    with WeightSyncClient(None, backend="ipc", bus=bus) as client:
        timings = client.send_weights(model.named_parameters(), version=version, pause="keep")
    steps = ", ".join(f"{k.removeprefix('engine_')} {v:.3f} s" for k, v in timings.items() if k.startswith("engine_"))
    print(f"  staged {timings['stage']:.2f} s, sync {timings['sync']:.2f} s; engine steps: {steps}")
    if sub.poll(10_000):
        msg = decode(sub.recv_multipart()[1:])
        assert isinstance(msg, WeightVersionCommitted)
        print(f"committed on the bus: version={msg.version!r} weight_epoch={msg.weight_epoch}")
    else:
        print("no WeightVersionCommitted on the bus within 10 s")
        return 1
    ctx.destroy(linger=0)
    for t in threads:
        t.join()

    ok, switch = True, []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        spans = " ".join(f"{s['start']}-{s['end'] - 1} {s['version']}" for s in o["spans"])
        print(f"rollout {i}: tokens {spans} | {tok.decode(p + o['ids'][:12])!r}...")
        ok &= [s["version"] for s in o["spans"]] == ["default", version]
        switch.append(o["spans"][-1]["start"] if o["spans"] else 0)
    if not ok:
        print(f"MISMATCH: every rollout should have two spans, default then {version}")
        return 1

    # vLLM-Ascend's check: greedy continuations of prompt + the tokens before the switch, computed afresh
    # under the new weights (one batch), must give exactly the tokens after the switch: keep + clear_cache
    # recomputed the rollouts' KV under the new weights. Their logprobs agree within TOL but not bitwise:
    # the rollouts ran in another batch (and recomputed their KV in one chunk), and a CPU matmul's
    # summation order depends on the batch's shape (rollbus is not batch-invariant here).
    n = max(len(o["ids"]) - k for o, k in zip(outs, switch))
    r = httpx.post(f"{url}/v1/completions", timeout=None, json={
        "prompt": [p + o["ids"][:k] for p, o, k in zip(prompts, outs, switch)], "max_tokens": n,
        "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
    r.raise_for_status()
    fresh = sorted(r.json()["choices"], key=lambda c: c["index"])
    for i, (p, o, k, c) in enumerate(zip(prompts, outs, switch, fresh)):
        after = o["ids"][k:]
        same = c["token_ids"][:len(after)] == after
        lp = max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], o["lps"][k:]))
        # and the trainer's own teacher-forced logprobs: old weights before the switch, new ones after it
        old = max(abs(a - b) for a, b in zip(teacher_forced(before, p, o["ids"][:k])[0], o["lps"][:k]))
        new = max(abs(a - b) for a, b in zip(teacher_forced(model, p + o["ids"][:k], after)[0], o["lps"][k:]))
        print(f"rollout {i}: {len(after)} tokens after the switch == fresh greedy continuation: {same} "
              f"(logprobs max |diff| {lp:.1e}); trainer's logprobs max |diff|: old weights {old:.1e}, "
              f"new weights {new:.1e}")
        ok &= same and max(lp, old, new) <= TOL

    if not ok:
        print("MISMATCH")
        return 1
    print(f"OK: every rollout switched to {version} mid-flight and continued exactly as the new weights would")
    return 0


if __name__ == "__main__":
    sys.exit(main())
