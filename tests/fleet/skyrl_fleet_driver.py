"""Runs inside the fleet venv (`bash tests/interop/setup_venvs.sh fleet`: Ray 2.60, SkyRL 0.4, vllm-router):
SkyRL's own ServerGroup places two rollbus engines (engine.fleet.skyrl_actor.RollbusServerActor) on a CPU-only
Ray cluster with logical GPUs, SkyRL's VLLMRouter fronts them, SkyRL's RemoteInferenceClient generates through
the router with session ids and fans pause / resume / sleep / wake out to both. Then an engine is killed and
its actor brings it back; after a fleet weight update an actor's process is SIGKILLed: Ray restarts it (the
options engine.fleet.skyrl_compat applies), it starts its engine again on the same URL and the fleet's
version while the other engine keeps serving; the Ray actors are killed and no engine process survives them.
Prints one JSON line.

With `catch-up` (a third argument): engine 1 misses a fleet update (its processes stopped, the update pushed to
engine 0 alone, then killed), its actor's supervisor restarts it, and it comes back on the fleet's version by
peer catch-up (docs/fleet.md "Catch-up from a peer").

Usage (the test sets the environment): ROLLBUS_PYTHON=<rollbus's python> ROLLBUS_PYTHONPATH=<repo>
    python tests/fleet/skyrl_fleet_driver.py MODEL_DIR [PYTHONPATH entry for engine.fleet] [catch-up]
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


def server_group() -> ServerGroup:
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    cli_args = Namespace(model=MODEL, max_model_len=256, enable_sleep_mode=True, kv_cache_memory_bytes=16 << 20,
                         tensor_parallel_size=1, pipeline_parallel_size=1,
                         additional_config={"rl_config": {"enabled": True}},
                         weight_transfer_config={"backend": "gloo", "timeout_s": 60})
    return ServerGroup(cli_args, num_servers=2, start_port=int(os.environ.get("FLEET_START_PORT", "18400")),
                       server_actor_cls=RollbusServerActor)


async def main() -> dict:
    out: dict = {"compat": compat}
    group = server_group()
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


def descendants(pid: int) -> list[int]:
    """pid and every process under it, parents first."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop(0))
        todo.extend(children.get(out[-1], []))
    return out


def push(label: str, seed: int, urls: list[str]) -> dict:
    """A fleet weight update to `urls`, from rollbus's python (tests/fleet/push_update.py)."""
    p = subprocess.run([os.environ["ROLLBUS_PYTHON"], os.path.join(sys.argv[2], "tests", "fleet", "push_update.py"),
                        MODEL, label, str(seed), *urls], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.environ.get("ROLLBUS_PYTHONPATH", "")})
    if p.returncode != 0:
        raise RuntimeError(f"the fleet update {label} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


async def catch_up_main() -> dict:
    """Engine 1 misses fleet-2 (stopped while engine 0 alone takes it, then killed); its actor restarts it with
    the same command line (--weights-recovery-resume, catch-up on): it fetches fleet-2 from engine 0 and serves
    it, /weight_checker and greedy tokens equal to engine 0's."""
    out: dict = {"compat": compat}
    group = server_group()
    try:
        urls = [i.url for i in group.start()]
        actors = group.get_actors()
        say("servers started", urls)
        out["fleet-1"] = push("fleet-1", 1, urls)
        out["versions_before"] = [weight_version(u) for u in urls]
        tree = descendants(ray.get(actors[1].child_pid.remote()))
        for pid in tree:  # engine 1 down (every process of it), so that the trainer drops it from its list
            os.kill(pid, signal.SIGSTOP)
        out["fleet-2"] = push("fleet-2", 2, urls[:1])
        say("fleet-2 pushed to engine 0 alone; killing engine 1", tree)
        for pid in reversed(tree):
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        state = None
        while time.monotonic() - t0 < 180 and state is None:
            await asyncio.sleep(0.3)
            try:
                if ray.get(actors[1].restart_count.remote()) < 1:
                    continue
                h = httpx.get(urls[1] + "/health", timeout=2).status_code
            except httpx.HTTPError:
                continue
            if h == 200:
                state = "serving"
            elif h == 503 and "'fleet-2'" in complete(urls[1]).text:
                state = "503 naming the version"
        out["back_s"] = round(time.monotonic() - t0, 1)
        out["back_as"] = state
        out["versions_after"] = [weight_version(u) for u in urls]
        out["commit_info"] = [httpx.get(u + "/weight_commit_info", timeout=10).json() for u in urls]
        out["checksums_equal"] = len({json.dumps(httpx.post(u + "/weight_checker", json={"action": "checksum"},
                                                            timeout=60).json(), sort_keys=True) for u in urls}) == 1
        replies = [complete(u) for u in urls]
        out["same_tokens"] = all(r.status_code == 200 for r in replies) and \
            replies[0].json()["choices"][0]["text"] == replies[1].json()["choices"][0]["text"]
        log = open(ray.get(actors[1].log_path.remote()), errors="replace").read()
        done = [ln for ln in log.splitlines() if "catch_up.done" in ln]
        out["catch_up_done"] = done[-1][-300:] if done else None
        out["catch_up_s"] = float(done[-1].split("seconds=")[1].split()[0]) if done else None
    finally:
        group.shutdown()
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
    out: dict = {"update": push("fleet-1", 1, urls)}
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
    scenario = catch_up_main if sys.argv[3:] == ["catch-up"] else main
    print(json.dumps(asyncio.run(scenario()), default=str))
