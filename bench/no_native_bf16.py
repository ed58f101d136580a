"""A CPU without native bf16, emulated on a host that has it (bench/rollout.py --emulate-no-native-bf16).

Every library picks its code path from the CPU it finds, and each has a switch that caps what it uses; the
bench re-runs itself with all of them set, so that its own process (HF generate, the GEMM ceiling, the FMA
peak) and the servers it starts take the paths such a CPU takes:

- `avx2`: AMD Zen 2/3 (or an Intel CPU without AVX-512): AVX2 + FMA, no AVX-512, no bf16 instructions.
  `ATEN_CPU_CAPABILITY=avx2` (torch's own vectorised kernels: norms, softmax, dtype copies),
  `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN then reports no bf16 support, so torch's bf16 matmuls take its reference
  loop, and rollbus's packed linear sees no native bf16), `MKL_ENABLE_INSTRUCTIONS=AVX2` (torch's fp32 GEMMs),
  `ROLLBUS_CPU_KERNELS=avx2` (rollbus's C++ kernels built without their AVX-512 code, as `cflags` builds them
  on a CPU without AVX-512) and `ROLLBUS_CPU_PACKED_LINEAR=avx2` (what rollbus picks by default on such a
  CPU from another vendor than Intel: the AVX2 panel kernel, fp32 and bf16 weights).
- `avx512`: Intel Skylake-SP / Cascade Lake: AVX-512 without bf16 instructions. `ONEDNN_MAX_CPU_ISA=
  AVX512_CORE_VNNI` (no AMX, no AVX512-BF16: torch's bf16 matmuls take oneDNN's *emulated* bf16, as torch does
  on such a CPU) and `ROLLBUS_CPU_PACKED_LINEAR=avx512` (rollbus's default there: the AVX-512 panel kernel).

What this cannot capture: the other CPU's clock, caches and memory bandwidth (the host's are used), and its
vendor's microarchitecture (Zen 3 runs AVX2 at other throughputs than this Xeon's cores do).
"""

from __future__ import annotations

import os
import sys

EMULATIONS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ROLLBUS_CPU_KERNELS": "avx2", "ROLLBUS_CPU_PACKED_LINEAR": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ROLLBUS_CPU_PACKED_LINEAR": "avx512"},
}
LIKE = {"avx2": "AMD Zen 2/3: AVX2, no AVX-512, no bf16 instructions",
        "avx512": "Intel Cascade Lake: AVX-512, no bf16 instructions"}
TORCH_CAPABILITY = {"avx2": "AVX2", "avx512": "AVX512"}
HF_BF16 = {"avx2": "torch's reference bf16 loop (oneDNN reports no bf16)",
           "avx512": "oneDNN's emulated bf16 (no AMX, no AVX512-BF16)"}


def reexec_if_needed(choice: str | None) -> None:
    """Replace this process by itself with the emulation's variables set, unless they are set already: torch,
    oneDNN and MKL read theirs once, at start-up or first use."""
    if not choice:
        return
    env = EMULATIONS[choice]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def check(choice: str) -> str:
    """That torch took the emulated paths in this process (ValueError otherwise); a line for the report."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if cap != TORCH_CAPABILITY[choice] or bf16 != (choice == "avx512"):
        raise ValueError(f"--emulate-no-native-bf16 {choice}: torch runs {cap}, oneDNN bf16 {bf16}: "
                         "the emulation's variables were not honoured")
    return (f"EMULATED on this host ({LIKE[choice]}): " + " ".join(f"{k}={v}" for k, v in EMULATIONS[choice].items())
            + f"; torch's CPU capability {cap}, oneDNN bf16 {'emulated' if bf16 else 'none'}, HF bf16 on "
            + HF_BF16[choice] + "; the host's clock, caches and memory bandwidth are not emulated")


def expected_cpu_linear(choice: str, dtype: str) -> str:
    """/server_info's cpu_linear of a rollbus worker under the emulation."""
    return f"{choice}-prepacked" + (" (bf16 weights, fp32 sums)" if dtype == "bfloat16" else "")
