"""Runs in a Python with rollbus's dependencies and Ray (`bash tests/interop/setup_venvs.sh ray`:
~/.cache/rollbus-fleet/ray): a CPU-only Ray cluster with logical GPUs, `rollbus serve -tp 2
--distributed-executor-backend ray` on it, greedy generations, one worker actor killed with `ray.kill` (Ray
restarts it; the driver times how long until the engine answers again), then the launcher stopped and its
worker processes checked gone. Prints one JSON line; tests/test_ray_executor.py reads it.

    PYTHONPATH=$PWD ~/.cache/rollbus-fleet/ray/bin/python tests/fleet/ray_executor_driver.py MODEL_DIR \
        '{"prompts": [[5, 17, 99]], "max_tokens": 8, "kill": "worker-1", "args": ["--max-model-len", "128"]}'
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import ray


def say(*a) -> None:
    print(f"[driver {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(url: str, prompt: list[int], max_tokens: int, engine: int | None = None) -> list[int]:
    headers = None if engine is None else {"X-data-parallel-rank": str(engine)}  # that engine, or a 503
    r = httpx.post(url + "/inference/v1/generate", timeout=120, headers=headers, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is gone for our purpose
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> dict:
    model, spec = sys.argv[1], json.loads(sys.argv[2])
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    port, bus = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine.cli", "serve", model, "-tp", "2", "--distributed-executor-backend", "ray",
           "--port", str(port), "--bus-port-base", str(bus), "--master-port", str(free_port()), *spec.get("args", [])]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    if spec.get("pg"):  # `rollbus serve` started for an existing placement group (ROLLBUS_RAY_PLACEMENT_GROUP)
        from ray.util.placement_group import placement_group

        pg = placement_group(spec["pg"])
        ray.get(pg.ready(), timeout=60)
        env["ROLLBUS_RAY_PLACEMENT_GROUP"] = pg.id.hex()
    if spec.get("refused"):  # expected to stop before serving: its exit code and what it said
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        ray.shutdown()
        return {"exit_code": p.returncode, "stderr": p.stderr[-3000:]}
    log = open(spec.get("log", os.devnull), "ab")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"cmd": cmd}
    try:
        t0 = time.monotonic()
        while not healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"rollbus serve exited with {proc.returncode}")
            if time.monotonic() - t0 > 400:
                raise SystemExit("rollbus serve not healthy after 400 s")
            time.sleep(0.5)
        out["start_s"] = round(time.monotonic() - t0, 1)
        out["tokens"] = [generate(url, p, spec["max_tokens"]) for p in spec["prompts"]]
        if spec.get("pg"):
            out["launcher_said"] = [line for line in open(spec["log"], errors="replace") if "Ray workers" in line]
        actors = {n: ray.get_actor(f"{n}@{port}-{proc.pid}", namespace="rollbus") for n in ("worker-0", "worker-1")}
        out["workers"] = {n: ray.get(a.describe.remote(), timeout=60) for n, a in actors.items()}
        say("serving", out["workers"])
        victim = spec.get("kill")
        if victim:
            before = out["workers"][victim]
            t1 = time.monotonic()
            ray.kill(actors[victim], no_restart=False)
            while alive(before["pid"]) and time.monotonic() - t1 < 30:
                time.sleep(0.1)
            out["killed_worker_process_gone"] = not alive(before["pid"])
            tp = int(cmd[len(cmd) - 1 - cmd[::-1].index("-tp") + 1])
            engine = int(victim.split("-")[1]) // tp
            back, after = None, None
            while time.monotonic() - t1 < 120:
                try:  # the restarted actor (a call while Ray restarts it fails at once), then its engine serving
                    after = after or ray.get(actors[victim].describe.remote(), timeout=60)
                    out["tokens_after_restart"] = generate(url, spec["prompts"][0], spec["max_tokens"], engine)
                    back = time.monotonic() - t1
                    break
                except (httpx.HTTPError, ray.exceptions.RayError):
                    time.sleep(0.5)
            out["back_s"] = None if back is None else round(back, 1)
            after = after or ray.get(actors[victim].describe.remote(), timeout=60)
            out["restarted"] = {"actor_pid_changed": after["actor_pid"] != before["actor_pid"],
                                "pid_changed": after["pid"] != before["pid"], "env": after["env"]}
            out["workers"][victim + "_after"] = after
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["exit_code"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit_code"] = "killed"
        pids = [w["pid"] for w in out.get("workers", {}).values()]
        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        out["orphans"] = [p for p in pids if alive(p)]
        ray.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
