"""Runs inside the SkyRL venv (tests/interop/setup_venvs.sh): SkyRL 0.4's own RemoteInferenceClient
against a rollbus server. Prints one JSON object of what each call returned (or raised).

Usage: python skyrl_client.py BASE_URL MODEL_NAME
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
    PauseMode,
    RemoteInferenceClient,
)


async def attempt(coro):
    t0 = time.monotonic()
    try:
        return {"ok": await coro, "s": round(time.monotonic() - t0, 3)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t0, 3)}


def plain(o):
    """Dict-like results (TypedDicts, dicts keyed by server url) as JSON-able values."""
    return json.loads(json.dumps(o, default=str))


async def main(url: str, model: str) -> None:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    out = {}
    out["world_size"] = await attempt(client.get_world_size())
    ids = await attempt(client.tokenize(["Hello there, general", "Bye"]))
    out["tokenize"] = ids
    if "ok" in ids:
        out["detokenize"] = await attempt(client.detokenize(ids["ok"]))
    out["render"] = await attempt(client.render_chat_completion(
        {"json": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}}))
    prompt = ids["ok"][0] if "ok" in ids else [1, 2, 3]
    greedy = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0}
    out["generate"] = plain(await attempt(client.generate(
        {"prompt_token_ids": [prompt, prompt], "sampling_params": greedy, "cache_salt": "policy-v0"})))

    # keep pause: requests in flight freeze and resume; requests sent during the pause queue (vLLM v0.33)
    long = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    first = asyncio.create_task(attempt(client.generate({"prompt_token_ids": [prompt], "sampling_params": long})))
    await asyncio.sleep(0)  # let it go out before the pause
    deadline = time.monotonic() + 60
    while not await running(client, url) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out["pause_keep"] = plain(await attempt(client.pause(mode=PauseMode.KEEP)))
    paused_at = time.monotonic()
    late = asyncio.create_task(attempt(client.generate({"prompt_token_ids": [prompt], "sampling_params": greedy})))
    await asyncio.sleep(1.0)  # the late request must still be waiting: the engine is paused
    out["late_done_while_paused"] = late.done()
    out["first_done_while_paused"] = first.done()
    out["reset_prefix_cache_while_kept"] = plain(await attempt(client.reset_prefix_cache()))
    out["resume"] = plain(await attempt(client.resume()))
    out["paused_for_s"] = round(time.monotonic() - paused_at, 3)
    out["first"] = plain(await first)
    out["late"] = plain(await late)

    out["sleep"] = plain(await attempt(client.sleep(level=1)))
    out["is_sleeping_after_sleep"] = await attempt(client.is_sleeping())
    out["wake_up"] = plain(await attempt(client.wake_up()))
    out["is_sleeping_after_wake"] = await attempt(client.is_sleeping())
    out["generate_after_wake"] = plain(await attempt(client.generate(
        {"prompt_token_ids": [prompt], "sampling_params": greedy})))
    out["reset_prefix_cache"] = plain(await attempt(client.reset_prefix_cache()))
    await client.teardown()
    print(json.dumps(out))


async def running(client, url) -> bool:
    """Our own probe (not SkyRL's): has the request reached the engine?"""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return any(line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0")
               for line in text.splitlines())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
