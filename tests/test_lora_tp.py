"""LoRA with tensor parallelism (-tp 2 over CPU Gloo), split as vLLM splits it: column-parallel q/k/v and
gate/up keep B's rows of the rank's outputs, row-parallel o and down keep A's columns of the rank's inputs and
their partial delta is reduced with the partial product. An adapter from a folder and one pushed over the
weight-transfer path (each rank cuts its slice of the whole tensors) give logprobs within 1e-4 of HF + PEFT,
so the same as -tp 1; on tiny Qwen3-MoE too (slow lane), with LoRA on the experts: each rank keeps its
intermediate slice of every expert's gate_up B rows and down A columns, as the experts' weights are split."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from engine.trainer import WeightSyncClient
from tests.lora_helpers import check_peft, make_adapter
from tests.serve_process import free_port, start_server
from tests.tiny_models import make_tiny_checkpoint

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("arch", ["qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_tp2_adapters_from_a_folder_and_pushed_match_peft(tmp_path, arch):
    base = make_tiny_checkpoint(arch, tmp_path / "base")  # 4 heads, 2 KV heads, intermediate 160
    moe = arch == "qwen3_moe"  # PEFT turns gate/up/down into target_parameters on the experts
    a = make_adapter(base, tmp_path / "a", rank=4, seed=1)
    b = make_adapter(base, tmp_path / "b", rank=8, seed=2,
                     targets=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if moe
                     else ["k_proj", "o_proj", "up_proj", "down_proj"])
    server = start_server(tmp_path, str(base), "-tp", "2", "--master-port", str(free_port()), "--tokens-only",
                          "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"a={a}",
                          "--block-size", "4", "--max-model-len", "128", "--num-gpu-blocks-override", "96",
                          "--additional-config", '{"rl_config": {"enabled": true}}',
                          "--weight-transfer-config", '{"backend": "ipc", "timeout_s": 30}', timeout_s=400)
    try:
        check_peft(server.url, base, a, "a", 1)
        with WeightSyncClient(server.url, backend="ipc") as client:
            conf = json.loads((b / "adapter_config.json").read_text())
            client.send_lora("pushed", load_file(str(b / "adapter_model.safetensors")).items(), conf)
        check_peft(server.url, base, b, "pushed", 1)
    finally:
        server.stop()
