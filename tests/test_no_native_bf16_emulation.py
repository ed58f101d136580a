"""bench/rollout.py --emulate-no-native-bf16: in a process started with an emulation's variables, torch and
oneDNN take the paths of a CPU without native bf16, and rollbus's packed linear reports what the bench checks
/server_info's cpu_linear against."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import no_native_bf16

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
from bench import no_native_bf16
from ascend_ops import packed_linear
choice = sys.argv[1]
print(no_native_bf16.check(choice))
for dtype in ("float32", "bfloat16"):
    got, want = packed_linear.describe(getattr(torch, dtype)), no_native_bf16.expected_cpu_linear(choice, dtype)
    assert got == want, (dtype, got, want)
"""


@pytest.mark.slow  # a process per emulation; avx2 builds the kernels without AVX-512 once per machine
@pytest.mark.parametrize("choice", list(no_native_bf16.EMULATIONS))
def test_an_emulation_takes_the_paths_of_a_cpu_without_native_bf16(choice: str) -> None:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if choice == "avx512" and " avx512f " not in flags or " avx2 " not in flags:
        pytest.skip(f"{choice} needs a CPU with it")
    env = {**os.environ, **no_native_bf16.EMULATIONS[choice], "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", PROBE, choice], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("EMULATED on this host"), r.stdout


@pytest.mark.unit
def test_without_its_variables_the_check_refuses() -> None:
    """This process runs torch at its full capability: an emulation's check must not pass here (unless the
    host is such a CPU already)."""
    import torch

    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("not a host with AVX-512 and oneDNN bf16")
    with pytest.raises(ValueError, match="were not honoured"):
        no_native_bf16.check("avx2")
