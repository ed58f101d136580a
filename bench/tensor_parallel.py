"""-tp N against -tp 1 on one model: greedy tokens, the largest logprob differences, and the weight and KV
bytes each worker reports (measured by the workers from their own tensors, /server_info).

    PYTHONPATH=$PWD python bench/tensor_parallel.py --tp 3            # SmolLM2-135M (the default model)
    PYTHONPATH=$PWD python bench/tensor_parallel.py --model DIR --tp 2

The two servers run one after the other (a 2-core host), with the same flags but -tp.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serve_process import free_port, start_server  # noqa: E402

PROMPTS = [[5, 17, 99, 250, 31, 8, 77], [3, 1, 4, 1, 5, 9, 2, 6, 11, 400], [1, 2, 3, 4, 5, 6, 7, 8],
           [42, 424, 900, 12]]
RL = '{"rl_config": {"enabled": true}}'


def run(model: str | None, tp: int, tokens: int, work: Path) -> tuple[list[dict], dict[str, dict]]:
    args = ([model] if model else []) + ["-tp", str(tp), "--enable-scale-out", "--additional-config", RL,
                                         "--max-model-len", "128", "--num-gpu-blocks-override", "64",
                                         "--master-port", str(free_port())]
    s = start_server(work, *args, timeout_s=600)
    try:
        outs = []
        for p in PROMPTS:
            r = httpx.post(s.url + "/inference/v1/generate", timeout=600, json={"token_ids": p, "sampling_params": {
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": 3}})
            r.raise_for_status()
            outs.append(r.json()["choices"][0])
        return outs, httpx.get(s.url + "/server_info", timeout=60).json()["workers"]
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        one, w1 = run(a.model, 1, a.tokens, Path(d))
        many, wn = run(a.model, a.tp, a.tokens, Path(d))
    same = all(x["token_ids"] == y["token_ids"] for x, y in zip(one, many))
    sampled = top = 0.0
    for x, y in zip(one, many):
        for cx, cy in zip(x["logprobs"]["content"], y["logprobs"]["content"]):
            sampled = max(sampled, abs(cx["logprob"] - cy["logprob"]))
            top = max(top, *(abs(u["logprob"] - v["logprob"]) for u, v in zip(cx["top_logprobs"], cy["top_logprobs"])))
    base = w1["worker-0"]
    print(json.dumps({
        "tp": a.tp, "greedy_tokens_identical": same, "max_abs_logprob_diff_sampled": sampled,
        "max_abs_logprob_diff_top3": top,
        "tp1": {"weight_bytes": base["weight_bytes"], "kv_cache_bytes": base["kv_cache_bytes"]},
        "workers": {n: {"weight_bytes": w["weight_bytes"], "kv_cache_bytes": w["kv_cache_bytes"],
                        "weight_share": round(w["weight_bytes"] / base["weight_bytes"], 4),
                        "kv_share": round(w["kv_cache_bytes"] / base["kv_cache_bytes"], 4)}
                    for n, w in sorted(wn.items())},
    }, indent=1))


if __name__ == "__main__":
    main()
