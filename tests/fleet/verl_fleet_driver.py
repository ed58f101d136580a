"""Runs inside the verl venv (`bash tests/interop/setup_venvs.sh verl`: verl 0.9.1, Ray 2.60, torch CPU): verl's
own LLMServerManager starts two rollbus replicas (`rollout.name=rollbus`, found through the verl.plugins
entry point) in standalone mode on a CPU-only Ray cluster with logical GPUs, verl's LLMServerClient generates
through them, replicas abort and resume, free and restore their KV cache, and verl's own
CheckpointEngineManager.update_weights pushes a trainer's weights into both (checkpoint engine `rollbus`).
Prints one JSON line; tests/test_fleet_verl.py checks it.

Usage (the test sets the environment): ROLLBUS_PYTHON=<rollbus's python> ROLLBUS_PYTHONPATH=<repo>
ROLLBUS_FLEET_HOST=127.0.0.1 PYTHONPATH=<repo>:<folder with rollbus's dist-info>
    python tests/fleet/verl_fleet_driver.py MODEL_DIR
"""

import asyncio
import json
import os
import sys
import time
from types import SimpleNamespace

import httpx
import ray
import torch
import verl  # noqa: F401  (loads the verl.plugins entry points: rollbus registers here)
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout.llm_server import LLMServerManager

MODEL = sys.argv[1]
CE_KWARGS = {"rollbus": {"timeout_s": 60}}


def say(*a) -> None:
    print(f"[driver {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


class TinyTrainer(Worker):
    """A one-rank trainer as verl's engine workers expose it to CheckpointEngineManager: a checkpoint engine
    built with is_master, execute_checkpoint_engine, and update_weights sending the model's tensors."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM
        from verl.utils.import_utils import import_external_libs

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        import_external_libs("engine.fleet.verl_weights")
        self.checkpoint_engine = CheckpointEngineRegistry.new("rollbus", is_master=self.rank == 0,
                                                              bucket_size=64 << 20, **CE_KWARGS["rollbus"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(self.model.named_parameters(), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tensors(self) -> list:
        return [(n, p.detach().clone()) for n, p in self.model.named_parameters()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def checksums(self) -> dict:
        from engine.trainer import weight_checksums

        return weight_checksums(self.model.named_parameters())


def trainer_group() -> RayWorkerGroup:
    port = str(_free_port())
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    handle = ray.remote(TinyTrainer).options(num_cpus=0, runtime_env={"env_vars": env}).remote(MODEL)
    return RayWorkerGroup(worker_handles=[handle], ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TinyTrainer)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def running(url: str) -> float:
    text = (await asyncio.to_thread(httpx.get, url + "/metrics", timeout=10)).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


async def wait_running(url: str, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while await running(url) < 1:
        if time.monotonic() > end:
            raise TimeoutError(f"no request started on {url}")
        await asyncio.sleep(0.05)


def get(url: str, path: str) -> dict:
    return httpx.get(url + path, timeout=30).json()


async def main() -> dict:
    out: dict = {}
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    rollout = RolloutConfig(
        name="rollbus", nnodes=1, n_gpus_per_node=2, tensor_model_parallel_size=1, dtype="float32",
        prompt_length=64, response_length=64, max_model_len=256, max_num_seqs=16, load_format="auto",
        engine_kwargs={"rollbus": {"kv_cache_memory_bytes": 16 << 20, "block_size": 16}},
        checkpoint_engine=CheckpointEngineConfig(backend="rollbus", custom_backend_module="engine.fleet.verl_weights",
                                                 engine_kwargs=CE_KWARGS))
    model = HFModelConfig(path=MODEL)
    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=rollout, model=model))
    manager = None
    try:
        t0 = time.monotonic()
        manager = await LLMServerManager.create(config)
        out["start_s"] = round(time.monotonic() - t0, 1)
        replicas = manager.get_replicas()
        out["replica_classes"] = sorted({type(r).__name__ for r in replicas})
        servers = [r.server_handle for r in replicas]
        urls = await asyncio.gather(*[s.engine_url.remote() for s in servers])
        out["urls"], out["addresses"] = urls, manager.get_addresses()
        out["health"] = [httpx.get(u + "/health").status_code for u in urls]
        say("replicas up", urls)

        # generation: verl's client (load-balanced, sticky by request id), and each replica directly
        client = manager.get_client()
        prompt = [11, 12, 13, 14, 15, 16, 17, 18]
        greedy = {"temperature": 0.0, "max_tokens": 6, "logprobs": True}
        via_client = [await client.generate(f"req-{i}", prompt_ids=prompt, sampling_params=dict(greedy))
                      for i in range(4)]
        out["client_tokens"] = [o.token_ids for o in via_client]
        out["client_stop"] = sorted({o.stop_reason for o in via_client})
        direct = await asyncio.gather(*[s.generate.remote(prompt, dict(greedy), f"d{i}")
                                        for i, s in enumerate(servers)])
        out["direct_tokens"] = [o.token_ids for o in direct]
        out["direct_logprobs_len"] = [len(o.log_probs or []) for o in direct]
        ref = httpx.post(urls[0] + "/inference/v1/generate", timeout=60, json={
            "token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 6, "logprobs": 0}}).json()
        out["http_tokens"] = ref["choices"][0]["token_ids"]
        out["http_logprobs"] = [e["logprob"] for e in ref["choices"][0]["logprobs"]["content"]]
        out["direct_logprobs"] = direct[0].log_probs
        say("generated")

        # abort / resume: a running request comes back aborted with its partial tokens; one sent while
        # stopped waits for the resume; with reject_request it comes back aborted at once
        long = {"temperature": 0.0, "max_tokens": 180, "ignore_eos": True}
        task = asyncio.ensure_future(servers[0].generate.remote(prompt, dict(long), "long-1"))
        await wait_running(urls[0])
        aborted = await replicas[0].abort_all_requests()
        first = await task
        out["abort_result"] = aborted
        out["aborted"] = {"stop": first.stop_reason, "n": len(first.token_ids)}
        out["paused_after_abort"] = get(urls[0], "/is_paused")
        parked = asyncio.ensure_future(servers[0].generate.remote(prompt, dict(greedy), "parked"))
        done, _ = await asyncio.wait([parked], timeout=1.0)
        out["parked_while_stopped"] = not done
        await replicas[0].resume_generation()
        parked_out = await parked
        out["parked_after_resume"] = {"stop": parked_out.stop_reason, "tokens": parked_out.token_ids}
        await replicas[1].abort_all_requests(reject_request=True)
        rejected = await servers[1].generate.remote(prompt, dict(greedy), "rejected")
        out["rejected"] = {"stop": rejected.stop_reason, "tokens": rejected.token_ids}
        await replicas[1].resume_generation()
        out["paused_after_resume"] = [get(u, "/is_paused") for u in urls]
        say("abort/resume done")

        # sleep / wake: standalone replicas keep their memory (verl's rule); the KV cache is freed and
        # restored around a weight sync
        await asyncio.gather(*[r.sleep() for r in replicas])
        out["sleeping_standalone"] = [get(u, "/is_sleeping") for u in urls]
        await asyncio.gather(*[r.wake_up() for r in replicas])
        await asyncio.gather(*[r.release_kv_cache() for r in replicas])
        out["kv_released"] = [get(u, "/is_sleeping") for u in urls]
        await asyncio.gather(*[r.resume_kv_cache() for r in replicas])
        out["kv_resumed"] = [get(u, "/is_sleeping") for u in urls]
        say("sleep/wake done")

        # one weight update through verl's own CheckpointEngineManager
        trainer = trainer_group()
        trainer.perturb(seed=1)
        baseline = trainer.checksums()[0]
        ce = CheckpointEngineManager(rollout.checkpoint_engine, trainer, replicas)
        t0 = time.monotonic()
        metrics = await ce.update_weights(global_steps=1)
        out["update_s"] = round(time.monotonic() - t0, 2)
        out["update_metrics"] = sorted(metrics)
        out["versions"] = [get(u, "/weight_info")["weight_version"] for u in urls]
        out["weights_match"] = [httpx.post(u + "/weight_checker", timeout=60, json={
            "action": "compare", "baseline": baseline}).json()["match"] for u in urls]
        out["paused_after_update"] = [get(u, "/is_paused") for u in urls]
        after = await asyncio.gather(*[s.generate.remote(prompt, dict(greedy), f"after{i}")
                                       for i, s in enumerate(servers)])
        out["after_tokens"] = [o.token_ids for o in after]
        out["after_global_steps"] = [o.extra_fields.get("global_steps") for o in after]
        say("weights updated")

        # the adapter refuses tensors handed to a rollout worker: with checkpoint_engine.backend=rollbus the
        # engines take them from the trainer (verl's colocated `naive` flow, through the worker's update_weights)
        trainer.perturb(seed=2)
        tensors = trainer.tensors()[0]
        try:
            await naive_update(replicas[0], tensors, global_steps=2)
            out["naive_refused"] = "accepted"
        except Exception as e:  # noqa: BLE001 - verl wraps it in a RayTaskError
            out["naive_refused"] = str(e)[-300:]
        # bad input: an engine on another weight version; verl's next update is refused before any transfer,
        # naming it, and nothing commits
        httpx.post(urls[1] + "/update_weight_version", json={"new_version": "elsewhere"}, timeout=30)
        try:
            await ce.update_weights(global_steps=3)
            out["split_versions"] = "accepted"
        except Exception as e:  # noqa: BLE001 - verl wraps it in a RayTaskError
            out["split_versions"] = str(e)[-400:]
        out["versions_after_split"] = [get(u, "/weight_info")["weight_version"] for u in urls]
        out["weights_after_split"] = [httpx.post(u + "/weight_checker", timeout=60, json={
            "action": "compare", "baseline": baseline}).json()["match"] for u in urls]
        await asyncio.gather(*[r.resume_kv_cache() for r in replicas])  # verl leaves them stopped on an error
        await asyncio.gather(*[r.resume_generation() for r in replicas])

        # bad input: an engine that does not answer is refused before any transfer, naming it
        from engine.fleet.verl_weights import RollbusCheckpointEngine
        from engine.trainer.fleet import FleetError

        dead = f"http://127.0.0.1:{_free_port()}"
        bad = RollbusCheckpointEngine(1 << 20, is_master=True, timeout_s=10)
        bad.init_process_group(engine_urls=[urls[0], dead])
        t0 = time.monotonic()
        try:
            await bad.send_weights([("model.norm.weight", torch.ones(4))], global_steps=9)
            out["dead_engine"] = "accepted"
        except FleetError as e:
            out["dead_engine"] = str(e)
        out["dead_engine_s"] = round(time.monotonic() - t0, 2)
        out["versions_after_refusal"] = [get(u, "/weight_info")["weight_version"] for u in urls]
        try:
            RollbusCheckpointEngine.build_topology(1, 1, [{"role": "trainer"}, {"node_id": "x"}])
            out["foreign_rollout"] = "accepted"
        except ValueError as e:
            out["foreign_rollout"] = str(e)

        # an engine that does not answer: generate() fails naming it; its actor brings it back
        pid = await servers[1].child_pid.remote()
        os.kill(pid, 9)
        end = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        try:
            await servers[1].generate.remote(prompt, dict(greedy), "to-a-dead-engine")
            out["dead_generate"] = "answered"
        except Exception as e:  # noqa: BLE001 - Ray wraps it
            out["dead_generate"] = str(e).strip().splitlines()[-1]  # Ray's traceback, then our message
        t0 = time.monotonic()
        while time.monotonic() - t0 < 180 and not _healthy(urls[1]):
            await asyncio.sleep(0.5)
        out["restarted_s"] = round(time.monotonic() - t0, 1) if _healthy(urls[1]) else None
        back = await servers[1].generate.remote(prompt, dict(greedy), "after-restart")
        out["after_restart_stop"] = back.stop_reason

        pids = [await s.child_pid.remote() for s in servers]
        for s in servers:
            ray.kill(s)
        end = time.monotonic() + 60
        while time.monotonic() < end and any(_alive(p) for p in pids):
            await asyncio.sleep(0.3)
        out["engines_left_after_kill"] = sum(_alive(p) for p in pids)
    finally:
        ray.shutdown()
    return out


async def naive_update(replica, tensors: list, global_steps: int) -> None:
    """verl's colocated flow on a rollout worker: a `naive` checkpoint engine holding the tensors, then the
    worker's own update_weights (receive_weights -> RollbusServerAdapter.update_weights)."""
    [worker] = replica.workers

    def swap(self, tensors):
        from verl.checkpoint_engine.base import ColocatedCheckpointEngine

        self.saved_engine, self.checkpoint_engine = self.checkpoint_engine, ColocatedCheckpointEngine(1 << 20)
        self.checkpoint_engine.send_weights(tensors)

    def restore(self):
        self.checkpoint_engine = self.saved_engine

    await worker.__ray_call__.remote(swap, tensors)
    try:
        await worker.update_weights.remote(global_steps=global_steps)
    finally:
        await worker.__ray_call__.remote(restore)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its dead parent yet) counts as gone
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), default=str))
