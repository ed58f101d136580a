"""How many engines and workers there are and how they find each other: data and tensor parallelism
(bus.topology; docs/serving.md "Scale-out", docs/tensor-parallel.md), and the class mixed into every worker.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.argv import non_negative, positive
from engine.config.vllm_only import VllmFlag, vllm_dest


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = 1  # engines (a scheduler and its workers each) behind the gateway
    data_parallel_size_local: int | None = None  # engines on this host (None: all of them)
    data_parallel_start_rank: int = 0  # the first engine on this host
    data_parallel_rank: int = 0  # the engine a scheduler or worker process belongs to
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"  # vLLM's: where tp rank 0 hosts the group's TCPStore
    master_port: int = 29501  # vLLM's default; an engine's tp group rendezvous port
    distributed_timeout_seconds: int | None = None  # vLLM's: group set-up and collectives (None: 600 s)
    distributed_executor_backend: str = "mp"  # vLLM's: mp (processes of this host) | ray (engine.fleet.ray_executor)
    worker_extension_cls: str = ""  # module.Class mixed into every worker (workers.extension)

    @property
    def workers_per_engine(self) -> int:
        """Worker processes of one engine: its tensor-parallel workers."""
        return self.tensor_parallel_size


def add_args(p: argparse.ArgumentParser) -> None:
    d = ParallelConfig()
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size, metavar="N",
                   help="Tensor parallelism: N worker processes (one per device), each holding 1/N of the model "
                        "(Megatron-style: attention heads and the KV cache by KV head, MLP and MoE experts on "
                        "their intermediate dimension, the vocabulary); N must divide the attention heads, and "
                        "the KV heads or be a multiple of them (docs/tensor-parallel.md).")
    g.add_argument("--master-addr", default=d.master_addr,
                   help="Address where tp rank 0 hosts the tensor-parallel group's rendezvous (TCPStore).")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help="Port of that rendezvous (with -tp > 1; engine i of a data-parallel set uses this + i).")
    g.add_argument("--distributed-timeout-seconds", type=int, default=None,
                   help="Seconds the tensor-parallel group set-up and each of its collectives may take "
                        "(default 600); a worker whose peer died fails its step instead of waiting longer.")
    g.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend, metavar="{mp,ray}",
                   help="How an engine's worker processes are started (vLLM's flag). mp: by `rollbus serve` on this "
                        "host. ray: each worker is a Ray actor on a bundle of a placement group (the current one "
                        "when started inside one, else one created with a bundle per worker), so -tp spans hosts; "
                        "the bus becomes tcp with CURVE keys the launcher makes and hands to every worker, and Ray "
                        "restarts a dead worker actor. Needs `pip install rollbus[ray]` (docs/fleet.md).")
    g.add_argument("--data-parallel-size", "-dp", type=positive("--data-parallel-size"),
                   default=d.data_parallel_size, metavar="M",
                   help="Engines (a scheduler with its own workers each) behind the gateway, which routes each "
                        "request to the engine with the least outstanding work, or to the one its "
                        "X-data-parallel-rank header names. CPU: any M (each engine's worker uses the threads "
                        "OMP_NUM_THREADS gives it); accelerators: at most the devices present.")
    g.add_argument("--data-parallel-size-local", "-dpl", type=non_negative("--data-parallel-size-local"),
                   default=None, metavar="N",
                   help="Engines on this host (several hosts: docs/serving.md). Default: all of them.")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=non_negative("--data-parallel-start-rank"),
                   default=d.data_parallel_start_rank, metavar="R",
                   help="The first engine on this host; the host with 0 runs the coordinator and the gateway.")
    g.add_argument("--data-parallel-rank", "-dpn", type=non_negative("--data-parallel-rank"),
                   default=d.data_parallel_rank, metavar="R",
                   help="The engine a `rollbus scheduler` or `rollbus worker` process belongs to (what "
                        "`rollbus serve` passes each child; Procfile lines set it).")
    g.add_argument("--pipeline-parallel-size", "-pp", action=VllmFlag, dest=vllm_dest("pipeline_parallel_size"),
                   metavar="N", help="1 only.")
    g.add_argument("--num-workers", dest="num_workers_refused", default=None, metavar="N",
                   help="Refused: use --data-parallel-size N (-dp) for N model replicas, each an engine of its "
                        "own, or --tensor-parallel-size N (-tp) for one model split over N devices.")
    g.add_argument("--worker-extension-cls", default=d.worker_extension_cls,
                   help="module.Class mixed into every worker, as vLLM: its public methods become callable "
                        "through POST /collective_rpc (a dev endpoint); names it shares with the worker are "
                        "a start-up error; init_worker_extension / destroy_worker_extension hooks run if defined.")
