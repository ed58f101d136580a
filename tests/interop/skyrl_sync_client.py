"""Runs inside the SkyRL venv (tests/interop/setup_venvs.sh): SkyRL 0.4's RemoteInferenceClient, unmodified,
driving the colocated-sync sequence of its WorkerDispatch (fully async, offload_kv_for_weight_sync) against a
rollbus server, around a weight broadcast that the test runs with SkyRL's weight-sync client meanwhile.

  reference: the requests run uninterrupted; then the same requests again, and once each has sampled a few
  tokens: pause_generation (keep), reset_prefix_cache, sleep_for_weight_sync(offload_kv),
  wake_for_weight_sync(["weights"]), prints {"broadcast": true} and waits for a line on stdin (the test's
  broadcast), [offload_kv false: reset_prefix_cache(reset_running_requests=True)], wake_for_weight_sync(
  ["kv_cache"]), resume_generation. Prints one JSON object of what each call returned (or raised).

Usage: python skyrl_sync_client.py BASE_URL MODEL_NAME true|false
"""

import asyncio
import json
import sys
import time
import typing

import typing_extensions

# skyrl 0.4 declares Python >= 3.12 and uses typing.TypedDict with Required; 3.11's typing_extensions has it
typing.TypedDict = typing_extensions.TypedDict

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)

PROMPTS = ["The three laws of motion are", "Once upon a time, in a small village by the sea, there lived"]
SAMPLING = [{"max_tokens": 200, "temperature": 0.0, "logprobs": 0, "ignore_eos": True},
            {"max_tokens": 200, "temperature": 1.0, "seed": 7, "logprobs": 0, "ignore_eos": True}]


async def attempt(coro):
    t0 = time.monotonic()
    try:
        return {"ok": json.loads(json.dumps(await coro, default=str)), "s": round(time.monotonic() - t0, 3)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t0, 3)}


async def tokens_streamed(url: str) -> float:
    """Our own probe (not SkyRL's): tokens the gateway has received so far beyond each request's first (the
    inter-token latency histogram counts them as they arrive; vllm:generation_tokens counts at the end)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:inter_token_latency_seconds_count"))


async def main(url: str, model: str, offload_kv: bool) -> None:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    ids = await client.tokenize(PROMPTS)

    def batch():
        return [client.generate({"prompt_token_ids": [p], "sampling_params": sp}) for p, sp in zip(ids, SAMPLING)]

    out = {"reference": await attempt(asyncio.gather(*batch()))}
    before = await tokens_streamed(url)
    tasks = [asyncio.create_task(attempt(c)) for c in batch()]
    deadline = time.monotonic() + 300
    while await tokens_streamed(url) < before + 3 * len(PROMPTS) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # a probe of engine progress (no event tells a client), not a synchronisation
    out["pause"] = await attempt(client.pause_generation())
    out["done_at_pause"] = [t.done() for t in tasks]
    out["reset_while_frozen"] = await attempt(client.reset_prefix_cache())
    out["sleep"] = await attempt(client.sleep_for_weight_sync(offload_kv=offload_kv))
    out["wake_weights"] = await attempt(client.wake_for_weight_sync(tags=["weights"]))
    print(json.dumps({"broadcast": True}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not offload_kv:  # the sync resets the prefix cache (SkyRL's clear_kv_cache_on_weight_sync)
        out["reset_running"] = await attempt(client.reset_prefix_cache(reset_running_requests=True))
    out["wake_kv"] = await attempt(client.wake_for_weight_sync(tags=["kv_cache"]))
    out["resume"] = await attempt(client.resume_generation())
    out["frozen"] = [await t for t in tasks]
    await client.teardown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "true"))
