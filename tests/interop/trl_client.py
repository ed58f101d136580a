"""Runs inside the TRL venv (tests/interop/setup_venvs.sh): TRL 1.16's own VLLMClient against a rollbus
server, every HTTP call TRL's code. Prints one JSON object of what each call returned (or raised).

Usage: python trl_client.py BASE_URL
"""

import json
import sys
import time

import trl.generation.vllm_client as vc

# TRL's constructor refuses to run unless vLLM is importable, and three module constants describe the
# vLLM installed beside it. A trainer has vLLM >= 0.33 there; this venv has none (the server is rollbus),
# so set what TRL would have computed, and give init_communicator the get_ip it imports from vLLM. Nothing
# here replaces an HTTP call: those are all TRL's.
vc.is_vllm_available = lambda *a, **k: True
vc._HAS_RESET_PREFIX_CACHE_SUCCESS = True
vc._HAS_STATEFUL_TRAINER_ENGINE = True
vc.get_ip = lambda: "127.0.0.1"


def attempt(fn):
    t0 = time.monotonic()
    try:
        return {"ok": fn(), "s": round(time.monotonic() - t0, 3)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "s": round(time.monotonic() - t0, 3)}


def main(url: str) -> None:
    client = vc.VLLMClient(base_url=url, connection_timeout=60)
    out = {"model": client.model}
    out["generate"] = attempt(lambda: client.generate(["Hello, AI!", "Tell me a joke"], n=2, max_tokens=8,
                                                      temperature=0.0, logprobs=2))
    out["chat"] = attempt(lambda: client.chat([[{"role": "user", "content": "Hi"}]], max_tokens=6, temperature=0.0,
                                              logprobs=0))

    def get_weather(city: str) -> str:
        """Weather of a city.

        Args:
            city: the city
        """
        return "sunny"

    out["chat_tools"] = attempt(lambda: client.chat([[{"role": "user", "content": "Weather in Paris?"}]],
                                                    max_tokens=4, temperature=0.0, tools=[get_weather]))
    gen = out["generate"].get("ok")
    if gen:
        seq = gen["prompt_ids"][0] + gen["completion_ids"][0]
        out["sequence_logprobs"] = attempt(lambda: client.get_sequence_logprobs(
            [seq], [len(gen["prompt_ids"][0])], top_logprobs=3))
    out["structured_regex"] = attempt(lambda: client.generate(["Hi"], max_tokens=4, structured_outputs_regex="[ab]+"))
    out["reset_prefix_cache"] = attempt(client.reset_prefix_cache)
    out["server_info"] = attempt(client.get_server_info)
    out["world_size"] = attempt(client.get_world_size)
    out["init_communicator"] = attempt(lambda: client.init_communicator(device="cpu"))

    def empty_update():
        with client.weight_update():
            pass
        return True

    out["weight_update"] = attempt(empty_update)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
