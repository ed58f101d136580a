"""The fleet (docs/fleet.md): vLLM's serve Namespace as rollbus flags, the SkyRL 0.4 compat shim, SkyRL's
/skyrl/v1/generate, the Ray actor class driven directly (start, supervision, shutdown: in CI, no Ray needed),
and, marked `fleet` (venvs from `bash tests/interop/setup_venvs.sh router fleet`), vllm-router's kv_aware
routing on the engines' KV events and SkyRL's own ServerGroup + VLLMRouter + RemoteInferenceClient on Ray."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx
import pytest

from engine.fleet.serve_args import namespace_argv
from tests.router_process import SETUP, fleet_venvs, router_binary, start_router
from tests.serve_process import free_port
from tests.server_helpers import start_server, tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_a_vllm_namespace_becomes_rollbus_flags() -> None:
    ns = Namespace(model="/m", enable_sleep_mode=True, max_model_len=512, tensor_parallel_size=1,
                   pipeline_parallel_size=1, host="0.0.0.0", port=9, enable_prefix_caching=False, seed=0,
                   kv_events_config={"enable_kv_cache_events": False}, trust_remote_code=False, quantization=None)
    argv = namespace_argv(ns)
    assert argv[0] == "/m" and "--enable-sleep-mode" in argv and argv[argv.index("--max-model-len") + 1] == "512"
    assert "--no-enable-prefix-caching" in argv or "--disable-prefix-caching" in argv
    assert "--host" not in argv and "--port" not in argv  # the launcher's
    assert '--kv-events-config={"enable_kv_cache_events": false}' in argv
    assert namespace_argv(Namespace(model="/m")) == ["/m"]  # missing attributes: rollbus's defaults


@pytest.mark.unit
def test_refused_attributes_get_the_command_lines_message() -> None:
    from engine.config import parse_config

    with pytest.raises(SystemExit) as cli:
        parse_config(["/m", "--quantization", "fp8"])
    with pytest.raises(SystemExit) as ns:
        namespace_argv({"model": "/m", "quantization": "fp8"})
    assert str(ns.value) == str(cli.value) and "--quantization fp8" in str(ns.value)
    with pytest.raises(SystemExit, match="distributed-executor-backend uni: not supported here"):
        namespace_argv({"model": "/m", "distributed_executor_backend": "uni"})
    assert namespace_argv({"model": "/m", "distributed_executor_backend": "ray"})[1:] == [
        "--distributed-executor-backend", "ray"]
    with pytest.raises(SystemExit, match="bogus_flag: not a flag of `vllm serve`"):
        namespace_argv({"model": "/m", "bogus_flag": 1})


@pytest.mark.unit
def test_the_skyrl_compat_shim(monkeypatch) -> None:
    import importlib.util
    import types

    from engine.fleet import skyrl_compat

    monkeypatch.delitem(sys.modules, skyrl_compat.VLLM_SERVER_ACTOR, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert skyrl_compat.stub_vllm_server_actor()
    stub = sys.modules[skyrl_compat.VLLM_SERVER_ACTOR]
    with pytest.raises(RuntimeError, match="RollbusServerActor"):
        stub.VLLMServerActor()
    monkeypatch.delitem(sys.modules, skyrl_compat.VLLM_SERVER_ACTOR)

    class RouterArgs:  # vllm-router 0.1.17's dataclass has vllm_pd_disaggregation only
        vllm_pd_disaggregation = False

    fake = types.ModuleType("vllm_router.router_args")
    fake.RouterArgs = RouterArgs
    monkeypatch.setitem(sys.modules, "vllm_router", types.ModuleType("vllm_router"))
    monkeypatch.setitem(sys.modules, "vllm_router.router_args", fake)
    assert skyrl_compat.router_args_pd_disaggregation()
    args = RouterArgs()
    args.vllm_pd_disaggregation = True
    assert args.pd_disaggregation is True
    assert not skyrl_compat.router_args_pd_disaggregation()  # once only

    # gap 3: ServerGroup's `ray.remote(cls).options(...)` gets the class's RAY_ACTOR_OPTIONS underneath
    made = []

    class FakeRay:
        @staticmethod
        def remote(*args, **options):
            if args:  # ray.remote(cls): SkyRL's own call
                return FakeRay.remote()(args[0])
            return lambda cls: types.SimpleNamespace(options=lambda **o: made.append((cls, options, o)))

    group_module = types.ModuleType(skyrl_compat.SERVER_GROUP)
    group_module.ray = FakeRay

    class ServerGroup:  # SkyRL 0.4's shape
        def __init__(self, cls):
            self._server_actor_cls = cls

        def _create_actor_class(self, pg, start_bundle_idx):
            return group_module.ray.remote(self._server_actor_cls).options(num_gpus=0, bundle=start_bundle_idx)

    group_module.ServerGroup = ServerGroup
    monkeypatch.setitem(sys.modules, skyrl_compat.SERVER_GROUP, group_module)
    assert skyrl_compat.server_group_actor_options()
    assert not skyrl_compat.server_group_actor_options()  # once only

    class Restartable:
        RAY_ACTOR_OPTIONS = {"max_restarts": -1}

    ServerGroup(Restartable)._create_actor_class(None, 3)
    ServerGroup(object)._create_actor_class(None, 4)
    assert made == [(Restartable, {"max_restarts": -1}, {"num_gpus": 0, "bundle": 3}),
                    (object, {}, {"num_gpus": 0, "bundle": 4})]
    assert group_module.ray is FakeRay


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir) -> Path:
    return tiny_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("fleet") / "tiny", smollm2_dir,
                                     vocab_size=49152)


def test_skyrl_generate_route(tmp_path, tiny_qwen3) -> None:
    """SkyRL's /skyrl/v1/generate shapes (what its RemoteInferenceClient reads); gated like
    /inference/v1/generate (the same check_enabled)."""
    s = start_server(tmp_path, str(tiny_qwen3), "--max-model-len", "256", "--enable-scale-out")
    try:
        body = {"token_ids": [5, 6, 7, 8], "model": str(tiny_qwen3),
                "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 0}}
        out = httpx.post(s.url + "/skyrl/v1/generate", json=body, timeout=60).json()
        ref = httpx.post(s.url + "/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
        [c] = out["choices"]
        assert c["token_ids"] == ref["token_ids"] and len(c["token_ids"]) == 5 and c["finish_reason"] == "length"
        assert [e["logprob"] for e in c["logprobs"]["content"]] == [e["logprob"] for e in ref["logprobs"]["content"]]
        assert c["routed_experts"] is None and c["rollout_sample_support"] is None  # a dense model
        r = httpx.post(s.url + "/skyrl/v1/generate", json={**body, "return_sample_support": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_sample_support"
    finally:
        s.stop()


@pytest.mark.unit
def test_the_actor_refuses_what_it_cannot_place_and_asks_ray_to_restart_it() -> None:
    from engine.fleet.skyrl_actor import RollbusServerActor

    with pytest.raises(ValueError, match="'ray' is not supported.*rollbus serve --distributed-executor-backend ray"):
        RollbusServerActor(Namespace(model="/m"), distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="enable_dp"):
        RollbusServerActor(Namespace(model="/m"), dp_size=2)
    assert RollbusServerActor.RAY_ACTOR_OPTIONS["max_restarts"] == -1  # skyrl_compat hands it to ServerGroup


def test_the_actor_starts_supervises_and_stops_its_engine(tmp_path, tiny_qwen3) -> None:
    """RollbusServerActor without Ray (the class Ray would wrap): start() returns once /health is 200,
    colocated means sleep mode, a killed engine comes back on its port and on the weight version it had
    committed (its recovery copies), shutdown leaves nothing; a refused flag fails start() with the command
    line's message."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.fleet.skyrl_actor import RollbusServerActor
    from engine.trainer import WeightSyncClient, weight_checksums

    async def run() -> None:
        bad = RollbusServerActor(Namespace(model=str(tiny_qwen3), quantization="fp8"), start_port=free_port())
        with pytest.raises(RuntimeError, match="--quantization fp8: not supported here"):
            await bad.start()
        cli = Namespace(model=str(tiny_qwen3), max_model_len=256, kv_cache_memory_bytes=8 << 20,
                        weight_transfer_config={"backend": "ipc"}, weights_recovery_dir=str(tmp_path / "copies"))
        actor = RollbusServerActor(cli, start_port=free_port(), server_idx=1, colocated_training=True,
                                   log_dir=str(tmp_path))
        info = await actor.start()
        url = f"http://127.0.0.1:{info.port}"
        try:
            assert httpx.get(url + "/health").status_code == 200
            assert httpx.post(url + "/sleep", params={"level": 1}, timeout=60).status_code == 200
            assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
            assert httpx.post(url + "/wake_up", timeout=60).status_code == 200
            trainer = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(0.5)
            with WeightSyncClient(url, backend="ipc") as client:  # an update, then the engine is lost
                await asyncio.to_thread(client.send_weights, trainer.named_parameters(), "actor-1")
            assert actor.weights_recovery_dir() == str(tmp_path / "copies" / "server-1")
            first = actor.child_pid()
            os.kill(first, 9)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not (actor.restart_count() == 1 and _healthy(url)):
                await asyncio.sleep(0.3)
            assert actor.restart_count() == 1 and _healthy(url) and actor.child_pid() != first
            # it rejoined on the update it had committed, not the checkpoint
            assert httpx.get(url + "/weight_info").json()["weight_version"] == "actor-1"
            r = httpx.post(url + "/weight_checker", timeout=60, json={
                "action": "compare", "baseline": weight_checksums(trainer.named_parameters())})
            assert r.json()["match"], r.text
        finally:
            await actor.shutdown()
        assert actor.child_pid() is None and not _healthy(url)

    asyncio.run(run())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------- the fleet lane


@pytest.mark.fleet
def test_kv_aware_sends_a_prompt_back_to_the_engine_that_holds_it(tmp_path, tiny_qwen3) -> None:
    """Two engines publishing KV events behind vllm-router's kv_aware: every repeat of a prompt finds its
    blocks cached (round-robin would find them half the time)."""
    if router_binary() is None:
        pytest.skip(f"vllm-router is not installed: {SETUP}")
    engines = []
    try:
        for _ in range(2):
            port = free_port()
            cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
            engines.append((start_server(tmp_path, str(tiny_qwen3), "--enable-scale-out", "--kv-events-config", cfg),
                            f"tcp://127.0.0.1:{port}"))
        router = start_router(tmp_path, [s.url for s, _ in engines], "kv_aware",
                              kv_sources={s.url: ep for s, ep in engines}, model=str(tiny_qwen3))
        try:
            cached, full = [], []
            for rep in range(3):
                for p in range(6):
                    prompt = f"conversation {p}: " + " ".join(f"word{p * 7 + i}" for i in range(60))
                    r = httpx.post(router.url + "/v1/completions", json={
                        "model": str(tiny_qwen3), "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
                    u = r.json()["usage"]
                    if rep:
                        cached.append(u["prompt_tokens_details"]["cached_tokens"])
                        full.append((u["prompt_tokens"] - 1) // 16 * 16)
                time.sleep(0.3)  # the events of the last turn reach the router
            assert cached == full, f"kv_aware missed cached prefixes: {cached} vs {full}\n{router.log()[-2000:]}"
        finally:
            router.stop()
    finally:
        for s, _ in engines:
            s.stop()


@pytest.mark.fleet
@pytest.mark.timeout(600)
def test_the_events_announce_every_prefix_before_the_next_turn(tmp_path) -> None:
    """bench/fleet_routing.py at a small scale: from turn 1 on, the engine holding a conversation had announced
    its whole reusable prefix (KV events, as a second subscriber saw them) before the turn was sent, every
    BlockStored chained to a block announced before; kv_aware with session affinity reuses >= 90% of the
    ideal. (Plain kv_aware's shortfall is the router's load term: docs/fleet.md.)"""
    if router_binary() is None:
        pytest.skip(f"vllm-router is not installed: {SETUP}")
    out = tmp_path / "routing.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet_routing.py"), "--conversations", "8",
                        "--turns", "3", "--policies", "kv_aware", "kv_aware_affinity", "--json", str(out)],
                       capture_output=True, text=True, timeout=500, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["unanchored_events"] == 0
    for policy, r in report["results"].items():
        later = [row for row in r["rows"] if row["turn"] >= 1]
        # (>= 98%: the second subscriber's thread may read the last batch a moment after the client's reply)
        assert sum(row["held"] for row in later) >= 0.98 * sum(row["ideal"] for row in later), (policy, later)
    assert report["results"]["kv_aware_affinity"]["of_ideal"] >= 0.9, report["results"]["kv_aware_affinity"]


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_skyrl_server_group_places_two_engines_on_ray(tmp_path, tiny_qwen3) -> None:
    """SkyRL 0.4's ServerGroup + VLLMRouter + RemoteInferenceClient, unmodified but for the compat shim,
    with RollbusServerActor on `ray.init(num_cpus=4, num_gpus=2)`."""
    out = _skyrl_driver(tmp_path, tiny_qwen3)
    assert out["health"] == [200, 200]
    assert all(len(g) == 6 for g in out["generate"]) and out["generate"][0] == out["generate"][2]
    assert out["paused"] == [{"is_paused": True}] * 2
    assert out["sleeping"] == [{"is_sleeping": True}] * 2 and out["awake"] == [{"is_sleeping": False}] * 2
    assert out["generate_after_wake"] == out["generate"][0]
    assert out["restarted"], out
    # the actor's process SIGKILLed after a fleet update: Ray restarts it, its engine is back on the same URL
    # within 90 s on the fleet's version (or a 503 naming it); the other engine served throughout
    assert out["update"]["version"] == "fleet-1" and out["versions_before"] == ["fleet-1"] * 2, out
    assert out["actor_restarted"] and not out["old_child_alive"], out
    assert out["actor_back_as"] is not None and out["actor_back_s"] <= 90, out
    if out["actor_back_as"] == "serving":
        assert out["versions_after"] == ["fleet-1"] * 2 and out["same_tokens_as_the_other"], out
    assert out["other_engine_served"] > 0 and out["other_engine_failed"] == [], out
    assert out["engine_pids_before"] >= 2 and out["engine_pids_after_kill"] == 0, out
    print("actor killed after a fleet update:", {k: out[k] for k in (  # pytest -s shows the timings
        "actor_back_s", "actor_back_as", "other_engine_served", "update", "restart_s")})


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_skyrl_server_group_engine_that_missed_an_update_catches_up(tmp_path, tiny_qwen3) -> None:
    """SkyRL's ServerGroup with RollbusServerActor: both engines take fleet-1; engine 1 is down (its processes
    stopped) while engine 0 alone takes fleet-2, then killed; its actor's supervisor restarts it, and it
    fetches fleet-2 from engine 0 (peer catch-up) before serving: /weight_checker and greedy tokens equal."""
    out = _skyrl_driver(tmp_path, tiny_qwen3, "catch-up")
    assert out["versions_before"] == ["fleet-1"] * 2, out
    assert out["back_as"] == "serving" and out["back_s"] <= 90, out
    assert out["versions_after"] == ["fleet-2"] * 2 and out["commit_info"][0] == out["commit_info"][1], out
    assert out["catch_up_done"] and "fleet-2" in out["catch_up_done"], out
    assert out["checksums_equal"] and out["same_tokens"], out
    print("engine that missed fleet-2, restarted by its actor:",
          {k: out[k] for k in ("back_s", "catch_up_s", "fleet-2")})


def _skyrl_driver(tmp_path: Path, model: Path, *args: str) -> dict:
    """tests/fleet/skyrl_fleet_driver.py in the fleet venv (skipped without it); its JSON line."""
    python = fleet_venvs() / "fleet" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"the fleet venv is absent ({python}): bash tests/interop/setup_venvs.sh fleet")
    # Ray's workers import engine.fleet from PYTHONPATH; the engines run in rollbus's python (ROLLBUS_PYTHON)
    env = {**os.environ, "ROLLBUS_PYTHON": sys.executable, "ROLLBUS_PYTHONPATH": str(ROOT),
           "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "FLEET_START_PORT": str(free_port())}
    p = subprocess.run([str(python), str(ROOT / "tests" / "fleet" / "skyrl_fleet_driver.py"), str(model),
                        str(ROOT), *args], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, f"driver failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])
