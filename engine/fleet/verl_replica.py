"""verl 0.9.1's rollout backend for rollbus: `actor_rollout_ref.rollout.name=rollbus`.

RollbusReplica is a verl RolloutReplica: launch_servers() places one RollbusHttpServer Ray actor per replica
beside the replica's workers (node affinity, their GPU ids), and that actor starts one `rollbus serve` as
its child (engine.fleet.skyrl_actor.RollbusServerActor: supervision, health, devices) and serves verl's
server protocol over the engine's HTTP routes: generate(...) -> TokenOutput through /inference/v1/generate,
abort_all_requests / resume_generation through /pause?mode=abort and /resume (requests that arrive while
generation is stopped wait for the resume, or come back aborted with reject_request, as verl's vLLM server
does), sleep / wake_up / release_kv_cache / resume_kv_cache through /sleep and /wake_up with tags, and
clear_kv_cache through /reset_prefix_cache. The config mapping is engine.fleet.verl_config; weights move
through engine.fleet.verl_weights. verl finds the backend through the `verl.plugins` entry point
(engine.fleet.verl_plugin). docs/fleet.md has the recipe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from argparse import Namespace
from typing import Any

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_resource_name
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from engine.fleet.skyrl_actor import RollbusServerActor
from engine.fleet.verl_config import check_rollout, serve_namespace

logger = logging.getLogger(__name__)

SERVER_PREFIX = "rollbus_server_"
BASE_PORT = int(os.environ.get("ROLLBUS_VERL_BASE_PORT", "18600"))
PAUSED_RETRY_S = 600.0  # how long generate() rides out a pause someone else put on the engine


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{SERVER_PREFIX}{replica_rank}_0{suffix}"


class EngineError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"rollbus engine {url}: {message} ({status})")
        self.status = status


class RollbusHttpServer:
    """One rollbus engine of a verl replica (the counterpart of verl's vLLMHttpServer)."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: RolloutMode, workers: list, replica_rank: int,
                 node_rank: int, gpus_per_node: int, nnodes: int, cuda_visible_devices: str):
        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.rollout_mode = rollout_mode
        self.workers = workers
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        model_path = getattr(model_config, "local_path", None) or model_config.path
        cli = Namespace(**serve_namespace(self.config, model_path, model_config))
        gpu_ids = [int(g) for g in str(cuda_visible_devices).split(",") if g.strip()]
        self.child = RollbusServerActor(cli, start_port=BASE_PORT + 50 * replica_rank, server_idx=replica_rank,
                                        colocated_training=rollout_mode != RolloutMode.STANDALONE, gpu_ids=gpu_ids)
        self.url: str | None = None
        self.http: httpx.AsyncClient | None = None
        # verl's gate: closed by abort_all_requests, opened by resume_generation
        self.gate = asyncio.Event()
        self.gate.set()
        self.rejecting = False
        self.in_flight: set[str] = set()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def launch_server(self) -> tuple[str, int]:
        info = await self.child.start()
        self.url = f"http://127.0.0.1:{info.port}"  # the engine is this actor's child, on this host
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return info.ip, info.port

    def get_server_address(self) -> tuple[str, int]:
        info = self.child.get_server_info()
        return info.ip, info.port

    def engine_url(self) -> str:
        """Where the trainer reaches this engine (the node's address)."""
        return self.child.get_server_info().url

    def child_pid(self) -> int | None:
        return self.child.child_pid()

    async def shutdown(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        await self.child.shutdown()

    # --- generation --------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: dict | None = None, priority: int = 0, **kwargs: Any) -> TokenOutput:
        """Tokens in, tokens out (verl's vLLMHttpServer.generate, on /inference/v1/generate)."""
        for name, value in (("image_data", image_data), ("video_data", video_data), ("audio_data", audio_data),
                            ("mm_processor_kwargs", mm_processor_kwargs), *kwargs.items()):
            if value:
                raise ValueError(f"rollbus engine {self.url}: generate({name}=...) is not supported (text models)")
        body = {"request_id": request_id, "token_ids": list(map(int, prompt_ids)),
                "sampling_params": self._sampling(len(prompt_ids), dict(sampling_params))}
        if priority:
            body["priority"] = priority
        deadline = time.monotonic() + PAUSED_RETRY_S
        delay = 0.1
        while True:
            if not self.gate.is_set():
                if self.rejecting:
                    return self._aborted()
                await self.gate.wait()
            self.in_flight.add(request_id)
            try:
                r = await self._send("/inference/v1/generate", json=body)
            finally:
                self.in_flight.discard(request_id)
            if r.status_code == 503 and "paused" in r.text and time.monotonic() < deadline:
                if self.gate.is_set():  # paused by someone else: back off and retry, as docs/rl.md says
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                continue  # our own pause: wait for the gate
            if r.status_code != 200:
                raise EngineError(self.url, r.status_code, _message(r))
            return self._token_output(r.json(), bool(body["sampling_params"].get("logprobs") is not None))

    def _sampling(self, prompt_len: int, sp: dict[str, Any]) -> dict[str, Any]:
        """verl's vLLM server's rules: max_tokens (or max_new_tokens) capped by the context, logprobs as a
        switch, repetition_penalty / ignore_eos / seed from the rollout config."""
        cfg = self.config
        room = int(cfg.max_model_len or cfg.prompt_length + cfg.response_length) - prompt_len
        if room < 1:
            raise ValueError(f"Prompt length ({prompt_len}) leaves no room to generate within max_model_len")
        if "max_tokens" in sp:
            max_tokens = sp.pop("max_tokens")
        elif "max_new_tokens" in sp:
            max_tokens = sp.pop("max_new_tokens")
        else:
            max_tokens = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        sp["max_tokens"] = max(1, min(int(max_tokens), room))
        sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
        sp.setdefault("repetition_penalty", cfg.repetition_penalty)
        sp.setdefault("ignore_eos", cfg.ignore_eos)
        if cfg.full_determinism:
            sp.setdefault("seed", self.replica_rank + cfg.seed)
        return {k: v for k, v in sp.items() if v is not None}

    def _token_output(self, out: dict[str, Any], with_logprobs: bool) -> TokenOutput:
        [choice] = out["choices"]
        finish = choice.get("finish_reason")
        stop = "aborted" if finish == "abort" else "completed" if finish in ("stop", "length") else finish
        logprobs = None
        if with_logprobs and choice.get("logprobs"):
            logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return TokenOutput(token_ids=choice["token_ids"], log_probs=logprobs, stop_reason=stop,
                           extra_fields={"global_steps": self.global_steps, "num_cached_tokens": cached,
                                         "weight_versions": choice.get("weight_versions")})

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})

    # --- control (verl's server protocol) ----------------------------------------------------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False
                                 ) -> dict[str, Any]:
        """Close the gate, then abort what runs (their TokenOutput says "aborted"); the engine stays paused."""
        self.rejecting = reject_request
        self.gate.clear()
        ids = sorted(self.in_flight)
        await self._post("/pause", mode="abort", clear_cache=str(bool(reset_prefix_cache)).lower())
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        await self._post("/resume")
        self.rejecting = False
        self.gate.set()

    async def clear_kv_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def sleep(self) -> None:
        """Release weights and KV cache (level 1) when colocated with training; a standalone engine keeps
        its memory, as verl's vLLM server does."""
        if self.config.free_cache_engine and self.rollout_mode != RolloutMode.STANDALONE:
            await self._post("/sleep", level="1")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout_mode == RolloutMode.STANDALONE:
            return
        for tag in tags or ["weights", "kv_cache"]:
            await self._post("/wake_up", tags=tag)
        await self._post("/reset_prefix_cache")

    async def release_kv_cache(self) -> None:
        """Free the KV cache for a weight sync, keeping the weights in place (sleep, then wake the weights)."""
        if not self.config.free_cache_engine or self.rollout_mode == RolloutMode.COLOCATED:
            return
        await self._post("/sleep", level="1")
        await self._post("/wake_up", tags="weights")

    async def resume_kv_cache(self) -> None:
        if not self.config.free_cache_engine or self.rollout_mode == RolloutMode.COLOCATED:
            return
        await self._post("/wake_up", tags="kv_cache")
        await self._post("/reset_prefix_cache")

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **kwargs: Any) -> None:
        if self.config.profiler is not None and getattr(self.config.profiler, "tool", None):
            raise NotImplementedError("rollout profiling is not supported by the rollbus backend")

    async def stop_profile(self) -> None:
        await self.start_profile()

    async def _send(self, path: str, **kw: Any) -> httpx.Response:
        try:
            return await self.http.post(self.url + path, **kw)
        except httpx.HTTPError as e:  # a dead or restarting engine: say which, and what failed
            raise EngineError(self.url, 503, f"POST {path}: does not answer ({type(e).__name__}: {e})") from None

    async def _post(self, path: str, **params: str) -> dict[str, Any]:
        r = await self._send(path, params=params or None, timeout=300.0)
        if r.status_code != 200:
            raise EngineError(self.url, r.status_code, f"POST {path}: {_message(r)}")
        return r.json() if r.content.strip() else {}


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]


class RollbusReplica(RolloutReplica):
    """A verl rollout replica served by one `rollbus serve` engine (tensor parallelism inside it)."""

    def __init__(self, replica_rank: int, config: Any, model_config: Any, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = ""):
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        check_rollout(self.config, model_config)  # refused here, naming the field, before anything starts
        if self.nnodes != 1:
            raise ValueError(f"rollbus replica {replica_rank}: {self.world_size} GPUs do not fit one node of "
                             f"{gpus_per_node}; a rollbus replica runs on one node")
        self.server_class = ray.remote(RollbusHttpServer)

    async def launch_servers(self) -> None:
        assert len(self.workers) == self.world_size, f"{len(self.workers)} workers for world size {self.world_size}"
        resource = get_resource_name()
        infos = await asyncio.gather(*[w.__ray_call__.remote(lambda self: (
            ray.get_runtime_context().get_node_id(),
            (ray.get_runtime_context().get_accelerator_ids().get(resource) or [""])[0])) for w in self.workers])
        kind = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        name = server_name(self.replica_rank, self.name_suffix).replace(SERVER_PREFIX, SERVER_PREFIX + kind)
        server = self.server_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=infos[0][0], soft=False),
            name=name, max_concurrency=self.max_concurrency, num_cpus=0,
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=self.workers, replica_rank=self.replica_rank, node_rank=0,
                 gpus_per_node=self.gpus_per_replica_node, nnodes=1,
                 cuda_visible_devices=",".join(str(i[1]) for i in infos))
        self.servers = [server]
        ip, port = await server.launch_server.remote()
        self._server_handle = server
        self._server_address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        [result] = await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request)
                                          for s in self.servers])
        return result
