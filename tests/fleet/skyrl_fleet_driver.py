"""Runs inside the fleet venv (`bash tests/interop/setup_venvs.sh fleet`: Ray 2.60, SkyRL 0.4, vllm-router):
SkyRL's own ServerGroup places two rollbus engines (engine.fleet.skyrl_actor.RollbusServerActor) on a CPU-only
Ray cluster with logical GPUs, SkyRL's VLLMRouter fronts them, SkyRL's RemoteInferenceClient generates through
the router with session ids and fans pause / resume / sleep / wake out to both. Then an engine is killed and
its actor brings it back; after a fleet weight update an actor's process is SIGKILLed: Ray restarts it (the
options engine.fleet.skyrl_compat applies), it starts its engine again on the same URL and the fleet's
version while the other engine keeps serving; the Ray actors are killed and no engine process survives them.
Prints one JSON line.

Usage (the test sets the environment): ROLLBUS_PYTHON=<rollbus's python> ROLLBUS_PYTHONPATH=<repo>
    python tests/fleet/skyrl_fleet_driver.py MODEL_DIR [PYTHONPATH entry for engine.fleet]
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from argparse import Namespace

import typing_extensions

# skyrl 0.4 declares Python >= 3.12 and uses typing.TypedDict with Required; 3.11's typing_extensions has it
typing.TypedDict = typing_extensions.TypedDict

MODEL = sys.argv[1]
sys.path.insert(0, sys.argv[2])  # engine.fleet (stdlib + Ray only here; the engines run in rollbus's python)

from engine.fleet import skyrl_compat  # noqa: E402

compat = skyrl_compat.apply()

import httpx  # noqa: E402
import ray  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers.server_group import ServerGroup  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers.vllm_router import VLLMRouter  # noqa: E402
from vllm_router.router_args import RouterArgs  # noqa: E402

from engine.fleet.skyrl_actor import RollbusServerActor  # noqa: E402


def say(*a) -> None:
    print(f"[driver {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def pids_of(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and "engine.cli" in cmd:
                out.append(int(pid))
    return out


async def main() -> dict:
    out: dict = {"compat": compat}
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    cli_args = Namespace(model=MODEL, max_model_len=256, enable_sleep_mode=True, kv_cache_memory_bytes=16 << 20,
                         tensor_parallel_size=1, pipeline_parallel_size=1,
                         additional_config={"rl_config": {"enabled": True}},
                         weight_transfer_config={"backend": "gloo", "timeout_s": 60})
    group = ServerGroup(cli_args, num_servers=2, start_port=int(os.environ.get("FLEET_START_PORT", "18400")),
                        server_actor_cls=RollbusServerActor)
    router = None
    try:
        t0 = time.monotonic()
        infos = group.start()
        say('servers started')
        out["start_s"] = round(time.monotonic() - t0, 1)
        urls = [i.url for i in infos]
        out["urls"] = urls
        out["health"] = [httpx.get(u + "/health").status_code for u in urls]
        router = VLLMRouter(RouterArgs(worker_urls=urls, policy="consistent_hash", host="0.0.0.0", port=18480,
                                       log_level="warning"))
        router_url = router.start()
        say('router started')
        client = RemoteInferenceClient(proxy_url=router_url, server_urls=urls, data_parallel_size=1,
                                       model_name=MODEL)
        prompt = [11, 12, 13, 14, 15, 16, 17, 18]
        gen = []
        for sid in ("session-a", "session-b", "session-a"):
            r = await client.generate({"prompt_token_ids": [prompt], "sampling_params": {
                "max_tokens": 6, "temperature": 0.0}, "session_ids": [sid]})
            gen.append(r["response_ids"][0])
        out["generate"] = gen
        say('generated')
        out["pause"] = json.loads(json.dumps(await client.pause(), default=str))
        out["paused"] = [httpx.get(u + "/is_paused").json() for u in urls]
        out["resume"] = json.loads(json.dumps(await client.resume(), default=str))
        out["sleep"] = json.loads(json.dumps(await client.sleep(level=1), default=str))
        out["sleeping"] = [httpx.get(u + "/is_sleeping").json() for u in urls]
        out["wake"] = json.loads(json.dumps(await client.wake_up(), default=str))
        out["awake"] = [httpx.get(u + "/is_sleeping").json() for u in urls]
        r = await client.generate({"prompt_token_ids": [prompt], "sampling_params": {
            "max_tokens": 6, "temperature": 0.0}})
        out["generate_after_wake"] = r["response_ids"][0]
        await client.teardown()

        # supervision: kill engine 0's launcher; its actor restarts it on the same port
        actors = group.get_actors()
        pid = ray.get(actors[0].child_pid.remote())
        os.kill(pid, 9)
        t0 = time.monotonic()
        back = False
        while time.monotonic() - t0 < 120:
            try:
                if httpx.get(urls[0] + "/health", timeout=2).status_code == 200 and \
                        ray.get(actors[0].restart_count.remote()) >= 1:
                    back = True
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        out["restarted"] = back
        out["restart_s"] = round(time.monotonic() - t0, 1)

        out.update(await actor_killed_after_an_update(actors, urls))

        # a killed actor leaves no engine behind
        port_markers = [f"--port\x00{u.rsplit(':', 1)[1]}" for u in urls]
        out["engine_pids_before"] = sum(len(pids_of(m)) for m in port_markers)
        for a in actors:
            ray.kill(a)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and any(pids_of(m) for m in port_markers):
            await asyncio.sleep(0.5)
        out["engine_pids_after_kill"] = sum(len(pids_of(m)) for m in port_markers)
    finally:
        if router is not None:
            router.shutdown()
        try:
            group.shutdown()
        except Exception as e:  # noqa: BLE001 - actors killed above
            out["shutdown_error"] = type(e).__name__
        ray.shutdown()
    return out


def complete(url: str, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [11, 12, 13, 14, 15, 16, 17, 18], "max_tokens": max_tokens, "temperature": 0})


def weight_version(url: str) -> str | None:
    try:
        return httpx.get(url + "/weight_info", timeout=5).json()["weight_version"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def actor_killed_after_an_update(actors: list, urls: list[str]) -> dict:
    """A fleet update to both engines, then engine 0's actor process is SIGKILLed while engine 1 serves a
    steady stream of requests: Ray restarts the actor (same handle), which starts its engine on the same URL
    on the fleet's version (or a 503 naming it); engine 1 loses nothing."""
    out: dict = {}
    push = subprocess.run([os.environ["ROLLBUS_PYTHON"], os.path.join(sys.argv[2], "tests", "fleet", "push_update.py"),
                           MODEL, "fleet-1", "1", *urls], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.environ.get("ROLLBUS_PYTHONPATH", "")})
    if push.returncode != 0:
        raise RuntimeError(f"the fleet update failed:\n{push.stderr[-3000:]}")
    out["update"] = json.loads(push.stdout.strip().splitlines()[-1])
    out["versions_before"] = [weight_version(u) for u in urls]
    reference = complete(urls[1]).json()["choices"][0]["text"]

    served, failed, stop = [0], [], threading.Event()

    def other_engine() -> None:  # engine 1, directly, throughout
        while not stop.is_set():
            try:
                r = complete(urls[1], max_tokens=4)
                if r.status_code == 200:
                    served[0] += 1
                else:
                    failed.append(r.status_code)
            except httpx.HTTPError as e:
                failed.append(type(e).__name__)

    load = threading.Thread(target=other_engine, daemon=True)
    load.start()
    old_child = ray.get(actors[0].child_pid.remote())
    os.kill(ray.get(actors[0].actor_pid.remote()), signal.SIGKILL)
    t0 = time.monotonic()
    state = None
    while time.monotonic() - t0 < 120:
        await asyncio.sleep(0.3)
        try:  # the actor back (Ray restarted it) with a new engine, not the old one still shutting down
            child = ray.get(actors[0].child_pid.remote(), timeout=5)
        except (ray.exceptions.RayError, TimeoutError):
            continue
        if child is None or child == old_child:
            continue
        try:
            h = httpx.get(urls[0] + "/health", timeout=2)
            if h.status_code == 200 and weight_version(urls[0]) is not None:
                state = "serving"
                break
            if h.status_code == 503 and "'fleet-1'" in complete(urls[0]).text:
                state = "503 naming the version"
                break
        except httpx.HTTPError:
            pass
    out["actor_back_s"] = round(time.monotonic() - t0, 1)
    out["actor_back_as"] = state
    stop.set()
    load.join(70)
    out["other_engine_served"], out["other_engine_failed"] = served[0], failed[:5]
    out["actor_restarted"] = ray.get(actors[0].actor_restarted.remote())  # the handle SkyRL's pool holds
    out["old_child_alive"] = os.path.exists(f"/proc/{old_child}") and \
        open(f"/proc/{old_child}/stat").read().split()[2] != "Z"
    out["versions_after"] = [weight_version(u) for u in urls]
    r = complete(urls[0])
    out["same_tokens_as_the_other"] = r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), default=str))
