"""`--distributed-executor-backend ray` (docs/fleet.md "One engine's workers on Ray"): the flag's values and
refusals, the placement policy (engine.fleet.ray_placement, pure), the launcher's error without Ray, and,
marked `fleet` (Ray from `bash tests/interop/setup_venvs.sh ray`), a -tp 2 engine whose workers are Ray actors on
a CPU-only cluster with logical GPUs: the same tokens as the mp backend, a killed worker actor restarted by Ray
and serving again within 90 s, no process left after the launcher stops, and a placement group with too few
bundles refused naming both counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bus.topology import Topology
from engine.config import launcher_makes_keys, parse_config
from engine.fleet.ray_placement import PlacementError, device_env, device_key, plan
from tests.router_process import fleet_venvs
from tests.serve_process import free_port
from tests.server_helpers import start_server, tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 250, 31, 8, 77], [3, 1, 4, 1, 5, 9, 2, 6, 11, 400]]
ARGS = ["--max-model-len", "128", "--block-size", "4", "--num-gpu-blocks-override", "96", "--enable-scale-out",
        "--heartbeat-timeout-s", "20"]  # a loaded 2-core host: a kill is seen at once (the socket closes) anyway


def _refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    return str(e.value)


@pytest.mark.unit
def test_the_flag_takes_mp_and_ray_and_refuses_the_rest_as_vllm_does() -> None:
    default = parse_config([])
    assert default.parallel.distributed_executor_backend == "mp" and default.bus.bus_transport == "ipc"
    cfg = parse_config(["--distributed-executor-backend", "ray"])
    assert cfg.bus.bus_transport == "tcp" and launcher_makes_keys(cfg)  # tcp, with keys the launcher makes
    assert "--distributed-executor-backend" in cfg.to_argv() and "--bus-transport" in cfg.to_argv()
    assert not launcher_makes_keys(parse_config(["--distributed-executor-backend", "ray", "--bus-insecure"]))
    # not a value of vLLM's: vLLM's own message
    assert "Unrecognized distributed executor backend foo. Supported values are 'ray', 'mp'" in \
        _refusal(["--distributed-executor-backend", "foo"])
    for value in ("uni", "external_launcher", "my.pkg.Executor"):  # vLLM's, not rollbus's
        assert f"--distributed-executor-backend {value}: not supported here" in \
            _refusal(["--distributed-executor-backend", value])
    assert "--bus-transport ipc" in _refusal(["--distributed-executor-backend", "ray", "--bus-transport", "ipc"])
    assert "--bus-engine-hosts" in _refusal(["--distributed-executor-backend", "ray", "-dp", "2",
                                             "--bus-engine-hosts", "10.0.0.1,10.0.0.2"])
    assert "--data-parallel-size-local" in _refusal(["--distributed-executor-backend", "ray", "-dp", "2", "-dpl", "1"])
    # the mp backend's tcp still needs keys
    assert "needs keys" in _refusal(["--bus-transport", "tcp"])


@pytest.mark.unit
def test_placement_takes_one_device_bundle_per_worker_and_refuses_too_few_naming_the_counts() -> None:
    topo = Topology(dp=2, tp=2)
    bundles = [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1, "CPU": 2}, {"GPU": 1}]
    nodes = ["10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    p = plan(topo, bundles, nodes, "10.0.0.1", "GPU", bus_host="127.0.0.1", master_addr="127.0.0.1", insecure=False)
    assert [(s.name, s.bundle, s.node_ip) for s in p.slots] == [
        ("worker-0", 1, "10.0.0.1"), ("worker-1", 2, "10.0.0.1"), ("worker-2", 3, "10.0.0.2"),
        ("worker-3", 4, "10.0.0.2")]
    assert p.bus_host == "10.0.0.1"  # workers on another node: the bus listens on the launcher's node address
    assert p.master_addrs == ("127.0.0.1", "127.0.0.1")  # each engine's workers share a node
    assert p.workers_on("10.0.0.2") == 2
    across = plan(Topology(tp=2), bundles[1:4:2], ["10.0.0.1", "10.0.0.2"], "10.0.0.1", "GPU",
                  bus_host="127.0.0.1", master_addr="127.0.0.1", insecure=False)
    assert across.master_addrs == ("10.0.0.1",)  # tp across hosts: rank 0's node hosts the rendezvous
    with pytest.raises(PlacementError, match="--bus-insecure is refused"):
        plan(Topology(tp=2), bundles[1:4:2], ["10.0.0.1", "10.0.0.2"], "10.0.0.1", "GPU", bus_host="127.0.0.1",
             master_addr="127.0.0.1", insecure=True)
    local = plan(Topology(tp=2), bundles[1:3], nodes[1:3], "10.0.0.1", "GPU", bus_host="127.0.0.1",
                 master_addr="127.0.0.1", insecure=True)
    assert local.bus_host == "127.0.0.1" and not local.spans_nodes
    with pytest.raises(PlacementError) as e:
        plan(Topology(dp=1, tp=4), bundles, nodes, "10.0.0.1", "NPU", bus_host="127.0.0.1", master_addr="127.0.0.1",
             insecure=False, group="the placement group abc")
    assert str(e.value) == ("the placement group abc has 0 bundle(s) with a NPU (of 5 bundles); --tensor-parallel-size "
                            "4 x --data-parallel-size 1 needs 4, one per worker")
    assert device_key({"CPU": 4, "GPU": 2}) == "GPU" and device_key({"CPU": 4, "NPU": 8}) == "NPU"
    assert device_key({"CPU": 4}) == "CPU"


@pytest.mark.unit
def test_a_worker_sees_its_bundles_devices_or_its_share_of_the_cores() -> None:
    gpu = device_env({"GPU": ["3"]}, accelerator=True, bundle={"GPU": 1}, cpu_count=8, workers_on_node=2, environ={})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "3" and gpu["ASCEND_RT_VISIBLE_DEVICES"] is None
    npu = device_env({"NPU": ["5"]}, accelerator=True, bundle={"NPU": 1}, cpu_count=8, workers_on_node=2, environ={})
    assert npu["ASCEND_RT_VISIBLE_DEVICES"] == "5" and npu["CUDA_VISIBLE_DEVICES"] is None
    # CPU-only node with logical GPUs: no device variable, the node's cores shared out
    cpu = device_env({"GPU": ["1"]}, accelerator=False, bundle={"GPU": 1}, cpu_count=8, workers_on_node=2, environ={})
    assert cpu["CUDA_VISIBLE_DEVICES"] is None and cpu["OMP_NUM_THREADS"] == "4"
    assert device_env({}, accelerator=False, bundle={"CPU": 3}, cpu_count=8, workers_on_node=2,
                      environ={})["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in device_env({}, accelerator=False, bundle={}, cpu_count=8, workers_on_node=2,
                                               environ={"OMP_NUM_THREADS": "2"})


def test_without_ray_serve_stops_naming_the_extra(smollm2_dir, capsys) -> None:
    """In this Python Ray is absent: `rollbus serve --distributed-executor-backend ray` says how to get it."""
    try:
        import ray  # noqa: F401
        pytest.skip("Ray is installed in this Python")
    except ImportError:
        pass
    from engine.launcher import Launcher

    cfg = parse_config([str(smollm2_dir), "--distributed-executor-backend", "ray"])
    assert Launcher(cfg).run() == 2
    assert "pip install rollbus[ray]" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ on Ray


def ray_python() -> Path:
    python = fleet_venvs() / "ray" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"the Ray venv is absent ({python}): bash tests/interop/setup_venvs.sh ray")
    return python


def run_driver(tmp_path: Path, model: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    p = subprocess.run([str(ray_python()), str(ROOT / "tests" / "fleet" / "ray_executor_driver.py"), str(model),
                        json.dumps(spec)], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    lines = Path(spec["log"]).read_text(errors="replace").splitlines() if spec.get("log") else []
    log = "\n".join(line for line in lines if "GET /health" not in line)[-8000:]
    assert p.returncode == 0, f"driver failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}\n{log}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def moe(tmp_path_factory, smollm2_dir) -> Path:
    return tiny_model_with_tokenizer("qwen3_moe", tmp_path_factory.mktemp("ray") / "qwen3_moe", smollm2_dir)


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_tp2_on_ray_matches_mp_and_a_killed_worker_actor_comes_back(tmp_path, moe) -> None:
    ray_python()
    (tmp_path / "mp").mkdir()
    s = start_server(tmp_path / "mp", str(moe), "-tp", "2", "--master-port", str(free_port()), *ARGS, timeout_s=400)
    try:
        ref = [httpx.post(s.url + "/inference/v1/generate", timeout=120, json={
            "token_ids": p, "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
        ).json()["choices"][0]["token_ids"] for p in PROMPTS]
    finally:
        s.stop()
    log = tmp_path / "serve.log"
    out = run_driver(tmp_path, moe, {"prompts": PROMPTS, "max_tokens": 8, "kill": "worker-1", "args": ARGS,
                                     "log": str(log)})
    text = log.read_text(errors="replace")
    assert out["tokens"] == ref  # the same greedy tokens as the mp backend's -tp 2
    w = out["workers"]
    assert w["worker-0"]["accelerators"] == {"GPU": ["0"]} and w["worker-1"]["accelerators"] == {"GPU": ["1"]}
    for info in (w["worker-0"], w["worker-1"]):  # a CPU-only cluster: logical GPUs are CPU workers
        assert "CUDA_VISIBLE_DEVICES" not in info["env"] and int(info["env"]["OMP_NUM_THREADS"]) >= 1
    assert "bus on tcp 127.0.0.1" in text  # one node: the tcp bus on loopback, with the launcher's CURVE keys
    assert "bus.insecure" not in text
    assert out["killed_worker_process_gone"], out  # the actor took its worker process down
    assert out["restarted"]["actor_pid_changed"] and out["restarted"]["pid_changed"], out
    assert out["back_s"] is not None and out["back_s"] <= 90, out
    assert out["tokens_after_restart"] == ref[0]
    assert "Ray restarts it on its bundle" in text and "worker-1 is back" in text
    assert out["exit_code"] == 0 and out["orphans"] == [], out


@pytest.mark.fleet
@pytest.mark.timeout(600)
def test_dp2_on_ray_a_killed_worker_actor_brings_its_engine_back(tmp_path, moe) -> None:
    """-tp 1 -dp 2: two engines, one worker actor each; engine 1's actor killed, engine 1 serves again."""
    log = tmp_path / "serve.log"
    out = run_driver(tmp_path, moe, {"prompts": PROMPTS[:1], "max_tokens": 8, "kill": "worker-1", "log": str(log),
                                     "args": [*ARGS, "-tp", "1", "-dp", "2"]})
    assert out["tokens_after_restart"] == out["tokens"][0] and out["back_s"] <= 90, out
    assert out["restarted"]["actor_pid_changed"] and out["exit_code"] == 0 and out["orphans"] == [], out
    assert "worker-1 is back" in log.read_text(errors="replace")


@pytest.mark.fleet
@pytest.mark.timeout(600)
def test_workers_take_the_device_bundles_of_an_existing_placement_group(tmp_path, moe) -> None:
    log = tmp_path / "serve.log"
    out = run_driver(tmp_path, moe, {"prompts": PROMPTS[:1], "max_tokens": 4, "args": ARGS, "log": str(log),
                                     "pg": [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}]})
    assert len(out["tokens"][0]) == 4 and out["exit_code"] == 0 and out["orphans"] == [], out
    [said] = out["launcher_said"]
    assert "worker-0: bundle 1 on" in said and "worker-1: bundle 2 on" in said, said  # the CPU-only bundle is skipped


@pytest.mark.fleet
@pytest.mark.timeout(600)
def test_a_placement_group_with_too_few_bundles_is_refused_naming_the_counts(tmp_path, moe) -> None:
    out = run_driver(tmp_path, moe, {"prompts": [], "max_tokens": 1, "args": ARGS, "pg": [{"GPU": 1}],
                                     "refused": True})
    assert out["exit_code"] == 2, out
    assert "(ROLLBUS_RAY_PLACEMENT_GROUP) has 1 bundle(s) with a GPU (of 1 bundles); --tensor-parallel-size 2 x " \
           "--data-parallel-size 1 needs 2, one per worker" in out["stderr"], out["stderr"]


class _FakeRayWorkers:
    """What engine.launcher reads of engine.fleet.ray_executor.RayWorkers: poll() results, scripted."""

    def __init__(self, polls: list[tuple[list, list]]):
        self.polls, self.gone = polls, set()

    def poll(self):
        ready, dead = self.polls.pop(0) if self.polls else ([], [])
        self.gone |= {name for name, why in dead if why.startswith("ActorDiedError")}
        return ready, dead


@pytest.mark.unit
def test_the_launcher_counts_ray_restarts_against_max_restarts_and_says_when_a_worker_is_back(capsys) -> None:
    from engine.launcher import Launcher

    launcher = Launcher(parse_config(["--distributed-executor-backend", "ray", "--max-restarts", "2"]))
    died = ("worker-1", "ActorUnavailableError: The actor was restarted")
    launcher.ray = _FakeRayWorkers([([], [died]), ([("worker-1", {"pid": 42})], []), ([], [died]), ([], [died])])
    assert not launcher._ray_deaths(0.0)  # restart 1 of 2
    assert not launcher._ray_deaths(1.0)  # back
    assert not launcher._ray_deaths(2.0)  # restart 2 of 2
    assert launcher._ray_deaths(3.0)  # a third death within 60 s: give up
    err = capsys.readouterr().err
    assert "Ray restarts it on its bundle (restart 1 of 2 within 60s)" in err and "worker-1 is back (pid 42" in err
    assert "died 3 times within 60s (--max-restarts 2): giving up" in err
    launcher = Launcher(parse_config(["--distributed-executor-backend", "ray"]))
    launcher.ray = _FakeRayWorkers([([], [("worker-0", "ActorDiedError: the actor died")])])
    assert launcher._ray_deaths(0.0)  # Ray will not restart it (--max-restarts 0, or killed for good)
    assert "Ray will not restart it: giving up" in capsys.readouterr().err


def test_the_skyrl_actor_still_imports_without_rollbus_dependencies() -> None:
    """SkyRL's actor runs in a Python with Ray and the standard library only (the fleet venv): the helpers it
    shares with the worker actors (engine.fleet.child_process) must not pull zmq, structlog or msgspec in."""
    code = ("import sys\nfor m in ('zmq', 'structlog', 'msgspec', 'torch', 'numpy'): sys.modules[m] = None\n"
            "import engine.fleet.skyrl_actor")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
