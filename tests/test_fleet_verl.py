"""verl 0.9.1's rollout backend and checkpoint engine for rollbus (docs/fleet.md, "verl"): the rollout config
mapping and its refusals (pure, in CI), the `verl.plugins` entry point, and, marked `fleet` (the verl venv
from `bash tests/interop/setup_venvs.sh verl`), verl's own LLMServerManager + CheckpointEngineManager driving
two rollbus replicas on a CPU-only Ray cluster with logical GPUs (tests/fleet/verl_fleet_driver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.fleet.serve_args import namespace_argv
from engine.fleet.verl_config import VerlConfigError, serve_namespace, weight_backend
from tests.router_process import fleet_venvs
from tests.server_helpers import tiny_model_with_tokenizer

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]


def rollout(**kw) -> SimpleNamespace:
    """The RolloutConfig fields the mapping reads, with verl 0.9.1's defaults."""
    base = dict(name="rollbus", tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1,
                expert_parallel_size=1, dtype="bfloat16", prompt_length=512, response_length=512, max_model_len=None,
                max_num_seqs=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.5,
                enable_chunked_prefill=True, enable_prefix_caching=True, enforce_eager=False, seed=42,
                load_format="dummy", disable_log_stats=True, logprobs_mode="processed_logprobs",
                scheduling_policy="fcfs", cudagraph_capture_sizes=None, served_model_name=None,
                enable_sleep_mode=True, free_cache_engine=True, skip_tokenizer_init=True, engine_kwargs={},
                disaggregation=SimpleNamespace(enabled=False), mtp=SimpleNamespace(enable=False),
                enable_rollout_routing_replay=False, quantization_config_file=None,
                checkpoint_engine=SimpleNamespace(engine_kwargs={}))
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.unit
def test_verls_rollout_config_becomes_rollbus_flags() -> None:
    ns = serve_namespace(rollout(), "/m")
    argv = namespace_argv(ns)  # checked exactly as `rollbus serve` checks its command line
    assert argv[0] == "/m" and "--tokens-only" in argv and "--enable-sleep-mode" in argv
    assert argv[argv.index("--max-model-len") + 1] == "1024"  # prompt_length + response_length
    assert argv[argv.index("--load-format") + 1] == "dummy" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert '--weight-transfer-config={"backend": "ipc"}' in argv  # verl's default checkpoint engine: naive
    ce = SimpleNamespace(backend="rollbus", engine_kwargs={})
    assert serve_namespace(rollout(checkpoint_engine=ce), "/m")["weight_transfer_config"] == {
        "backend": weight_backend("auto")}
    assert '--additional-config={"rl_config": {"enabled": true}}' in argv
    ns = serve_namespace(rollout(max_model_len=256, skip_tokenizer_init=False, free_cache_engine=False,
                                 engine_kwargs={"rollbus": {"kv_cache_memory_bytes": 1 << 24}}), "/m")
    assert ns["max_model_len"] == 256 and "tokens_only" not in ns and "enable_sleep_mode" not in ns
    assert ns["kv_cache_memory_bytes"] == 1 << 24 and "gpu_memory_utilization" not in ns
    assert weight_backend("nccl") == "nccl" and weight_backend(None) == weight_backend("auto")


@pytest.mark.unit
def test_what_a_rollbus_replica_cannot_be_is_refused_naming_the_field() -> None:
    for field, value in [("data_parallel_size", 2), ("pipeline_model_parallel_size", 2),
                         ("expert_parallel_size", 4), ("disaggregation", SimpleNamespace(enabled=True)),
                         ("mtp", SimpleNamespace(enable=True)), ("enable_rollout_routing_replay", True)]:
        with pytest.raises(VerlConfigError, match=f"actor_rollout_ref.rollout.{field}"):
            serve_namespace(rollout(**{field: value}), "/m")
    with pytest.raises(VerlConfigError, match="model.lora_rank"):
        serve_namespace(rollout(), "/m", SimpleNamespace(lora_rank=8))
    with pytest.raises(VerlConfigError, match="engine_kwargs.rollbus.backend"):
        weight_backend("mpi")
    with pytest.raises(SystemExit, match="bogus: not a flag"):  # engine_kwargs.rollbus as on the command line
        namespace_argv(serve_namespace(rollout(engine_kwargs={"rollbus": {"bogus": 1}}), "/m"))


@pytest.mark.unit
def test_the_verl_plugin_entry_point_names_the_registering_module() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"] == {"rollbus": "engine.fleet.verl_plugin"}
    assert any(d.startswith("verl>=0.9.1") for d in project["optional-dependencies"]["verl"])


def dist_info(folder: Path) -> Path:
    """rollbus's entry points as `pip install rollbus` writes them, on a path the verl venv can import: verl
    finds its plugins through importlib.metadata, and rollbus is never installed into that venv."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    d = folder / f"rollbus-{project['version']}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rollbus\nVersion: {project['version']}\n")
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
             for group, eps in project["entry-points"].items()]
    (d / "entry_points.txt").write_text("\n".join(lines))
    return folder


@pytest.mark.fleet
@pytest.mark.timeout(900)
def test_verl_drives_two_rollbus_replicas(tmp_path, smollm2_dir) -> None:
    python = fleet_venvs() / "verl" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"the verl venv is absent ({python}): bash tests/interop/setup_venvs.sh verl")
    model = tiny_model_with_tokenizer("qwen3", tmp_path / "tiny", smollm2_dir, vocab_size=49152)
    env = {**os.environ, "ROLLBUS_PYTHON": sys.executable, "ROLLBUS_PYTHONPATH": str(ROOT), "RAY_ADDRESS": "",
           "ROLLBUS_FLEET_HOST": "127.0.0.1", "PYTHONPATH": f"{ROOT}:{dist_info(tmp_path / 'meta')}",
           # Ray's own start-up deadline (60 s) is missed on a loaded 2-core host; the node does come up
           "RAY_raylet_start_wait_time_s": os.environ.get("RAY_raylet_start_wait_time_s", "300")}
    p = subprocess.run([str(python), str(ROOT / "tests" / "fleet" / "verl_fleet_driver.py"), str(model)],
                       capture_output=True, text=True, timeout=840, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, f"driver failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("start_s", "update_s", "restarted_s")}))  # with -s: the timings
    assert out["replica_classes"] == ["RollbusReplica"] and out["health"] == [200, 200]
    assert all(u.startswith("http://127.0.0.1:") for u in out["urls"])
    # generation: verl's client and each replica directly agree with the engine's own route, bitwise
    ref = out["http_tokens"]
    assert len(ref) == 6 and out["client_tokens"] == [ref] * 4 and out["direct_tokens"] == [ref, ref]
    assert out["client_stop"] == ["completed"] and out["direct_logprobs"] == out["http_logprobs"]
    # abort / resume
    assert out["abort_result"]["request_ids"] == ["long-1"] and out["aborted"]["stop"] == "aborted"
    assert 0 < out["aborted"]["n"] < 180 and out["paused_after_abort"] == {"is_paused": True}
    assert out["parked_while_stopped"] and out["parked_after_resume"] == {"stop": "completed", "tokens": ref}
    assert out["rejected"] == {"stop": "aborted", "tokens": []}
    assert out["paused_after_resume"] == [{"is_paused": False}] * 2
    # sleep / wake (standalone: no-op, as verl's vLLM server) and the KV cache around a sync
    assert out["sleeping_standalone"] == [{"is_sleeping": False}] * 2
    assert out["kv_released"] == [{"is_sleeping": True}] * 2 and out["kv_resumed"] == [{"is_sleeping": False}] * 2
    # one update through verl's CheckpointEngineManager: both engines hold the trainer's weights bitwise
    assert out["versions"] == ["global_step_1"] * 2 and out["weights_match"] == [True, True]
    assert out["paused_after_update"] == [{"is_paused": False}] * 2 and "rollbus/transfer_s" in out["update_metrics"]
    assert out["after_tokens"][0] == out["after_tokens"][1] != ref and out["after_global_steps"] == [1, 1]
    # tensors handed to a rollout worker are refused (the engines' backend is the collective one); an engine
    # on another weight version makes verl's next update refused naming it, nothing committed
    assert "checkpoint_engine.backend=rollbus the engines take their weights" in out["naive_refused"]
    odd = out["urls"][1]
    assert f"engine {odd} is on weight version 'elsewhere'" in out["split_versions"], out["split_versions"]
    assert out["versions_after_split"] == ["global_step_1", "elsewhere"] and out["weights_after_split"] == [True] * 2
    # bad input, and no engine outlives its actor
    assert "does not answer" in out["dead_engine"] and out["dead_engine_s"] < 5.0
    assert out["versions_after_refusal"] == ["global_step_1", "elsewhere"]
    assert "rollout.name must be rollbus" in out["foreign_rollout"]
    # refused naming the engine: refused connections, or the 503 of its gateway still shutting down
    dead = out["dead_generate"]
    assert f"rollbus engine {out['urls'][1]}: " in dead and ("does not answer" in dead or "(503)" in dead), dead
    assert out["restarted_s"] is not None and out["after_restart_stop"] == "completed"
    assert out["engines_left_after_kill"] == 0
