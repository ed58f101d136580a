"""Weights from a verl trainer into rollbus replicas.

RollbusCheckpointEngine is a verl checkpoint-engine backend (`checkpoint_engine.backend=rollbus`,
`checkpoint_engine.custom_backend_module=engine.fleet.verl_weights`): verl's own
CheckpointEngineManager.update_weights drives it. The trainer's rank 0 pushes every tensor into every
rollbus engine of the replicas with rollbus's trainer client, engine.trainer.WeightSyncClient([url, ...]):
one collective group (Gloo on CPU, NCCL / HCCL on devices) spans the trainer and every engine's workers
with vLLM's rank layout, so each broadcast feeds every engine, and the update commits on every engine or on
none (the error names the engine). Nothing passes through verl's rollout workers: they only report their
engine's URL (prepare) and receive nothing. The other trainer ranks walk the weight generator (producing
each tensor is collective over the training group) and send nothing.

RollbusServerAdapter is the BaseRollout server adapter verl builds in each rollout worker
(`get_rollout_class("rollbus")`): resume / release map to the engine's wake_up / sleep, and update_weights
takes tensors that another path hands it (verl's colocated `naive` sync, another checkpoint engine) to the
engine of its replica with WeightSyncClient's ipc backend (shared memory on CPU, CUDA / NPU IPC handles on
devices); an engine takes one backend, so with `checkpoint_engine.backend=rollbus` that path is refused.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.utils import ensure_async_iterator

from engine.fleet.skyrl_actor import node_ip
from engine.fleet.verl_config import weight_backend
from engine.fleet.verl_replica import server_name
from engine.trainer import WeightSyncClient

_LOCAL_ADAPTER: RollbusServerAdapter | None = None  # the adapter of this rollout worker process


def version_of(global_steps: int | None) -> str | None:
    return None if global_steps is None else f"global_step_{global_steps}"


class RollbusServerAdapter(BaseRollout):
    """verl's server adapter for a rollbus replica (one per rollout worker; the replica's rank 0 leads)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any):
        if kwargs:
            raise TypeError(f"RollbusServerAdapter: unexpected arguments {sorted(kwargs)}")
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = self.config.tensor_model_parallel_size
        self.replica_rank = replica_rank if replica_rank >= 0 else rank // world
        self.rollout_rank = rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self._server = None
        global _LOCAL_ADAPTER
        _LOCAL_ADAPTER = self

    def server(self) -> Any:
        if self._server is None:  # the server starts after the workers
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def engine_url(self) -> str:
        return await self.server().engine_url.remote()

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank and self.config.free_cache_engine:
            await self.server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.is_leader_rank and self.config.free_cache_engine:
            await self.server().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"rollbus: wire_format {wire_format!r} (delta updates) is not supported; "
                                      "use checkpoint_engine.backend=rollbus")
        tensors = [(n, t) async for n, t in ensure_async_iterator(weights)]
        if not self.is_leader_rank:
            return
        if tensors and self.config.checkpoint_engine.backend == "rollbus":
            raise ValueError("rollbus: tensors were handed to the rollout worker, but with checkpoint_engine.backend="
                             "rollbus the engines take their weights from the trainer directly (collective); "
                             "send them through CheckpointEngineManager.update_weights")
        if tensors:  # tensors handed to this worker: into its engine, in place (the engine's backend is ipc)
            url = await self.engine_url()
            client = WeightSyncClient(url, backend="ipc", device=tensors[0][1].device)
            try:
                await asyncio.to_thread(client.send_weights, tensors, version_of(global_steps), "keep")
            finally:
                client.close()
        if global_steps is not None:
            await self.server().set_global_steps.remote(global_steps)


@CheckpointEngineRegistry.register("rollbus")
class RollbusCheckpointEngine(CheckpointEngine):
    """Trainer rank 0 -> every rollbus engine, over one collective group (WeightSyncClient).

    engine_kwargs (`checkpoint_engine.engine_kwargs.rollbus`): backend (auto: NCCL on CUDA, HCCL on
    Ascend, Gloo on CPU; the engines' --weight-transfer-config gets the same), timeout_s (300), packed
    (True: one broadcast per chunk), packed_buffer_size_bytes (the chunk; rollbus's default, not verl's
    update_weights_bucket_megabytes, since every engine worker holds its chunk buffers), rebuild_group
    (False: the group is formed once and kept while the engines stay the same).

    verl's trainer workers pass is_master (True on rank 0); its rollout workers pass none.
    """

    def __init__(self, bucket_size: int, is_master: bool | None = None, backend: str = "auto",
                 timeout_s: float = 300.0, packed: bool = True, packed_buffer_size_bytes: int | None = None,
                 rebuild_group: bool = False) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.buffer_size = packed_buffer_size_bytes
        self.backend = weight_backend(backend)
        self.timeout_s = float(timeout_s)
        self.packed = bool(packed)
        self.rebuild_group = bool(rebuild_group)
        self.client: WeightSyncClient | None = None
        self.urls: list[str] = []

    def prepare(self) -> dict[str, Any]:
        if self.is_master is not None:
            return {"role": "trainer"}
        adapter = _LOCAL_ADAPTER
        if adapter is None:
            raise RuntimeError("rollbus checkpoint engine: this rollout worker has no rollbus server adapter "
                               "(actor_rollout_ref.rollout.name must be rollbus)")
        if not adapter.is_leader_rank:
            return {"role": "rollout"}
        return {"role": "rollout", "engine_url": ray.get(adapter.server().engine_url.remote())}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        rollout = metadata[actor_wg_world_size:]
        urls = [m["engine_url"] for m in rollout if m.get("engine_url")]
        if len(urls) != len(set(urls)):
            raise ValueError(f"rollbus: an engine is listed twice among the rollout workers: {urls}")
        roles_ok = metadata[0].get("role") == "trainer" and all(m.get("role") == "rollout" for m in rollout)
        if not roles_ok or not urls:
            raise ValueError("rollbus checkpoint engine: the rollout workers are not rollbus replicas "
                             "(actor_rollout_ref.rollout.name must be rollbus)")
        return ({"engine_urls": [urls] + [None] * (actor_wg_world_size - 1)},
                {"engine_urls": [None] * rollout_world_size})

    def init_process_group(self, engine_urls: list[str] | None = None) -> None:
        """Trainer rank 0: a client for these engines (the group forms on the first send)."""
        if not engine_urls or not self.is_master:
            return
        if self.client is not None and engine_urls != self.urls:
            self.client.close()  # replicas were added or removed: a new group
            self.client = None
        if self.client is None:
            self.urls = list(engine_urls)
            self.client = WeightSyncClient(self.urls, backend=self.backend, packed=self.packed,
                                           timeout_s=self.timeout_s, master_address=node_ip(),
                                           packed_buffer_size_bytes=self.buffer_size)

    def finalize(self) -> None:
        if self.rebuild_group and self.client is not None:
            self.client.close()
            self.client = None

    @torch.no_grad()
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        if self.client is None:  # every trainer rank walks the generator; only rank 0 keeps the tensors
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        tensors = [(n, t) async for n, t in ensure_async_iterator(weights)]
        # verl has paused the replicas (abort_all_requests) and freed their KV cache: no pause here
        timings = await asyncio.to_thread(self.client.send_weights, tensors, version_of(global_steps), None)
        return {f"rollbus/{k}_s": v for k, v in timings.items()}

    async def receive_weights(self, global_steps: int | None = None):
        """Nothing passes through verl's rollout workers: the engines receive from the trainer directly."""
        return
        yield  # an async generator that yields nothing

