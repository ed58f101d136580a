"""What the launcher decides about this host before it starts any process, without importing torch where the
answer does not need it: which platform the workers will run on and how many devices it has (for the layout
check), and the environment a CPU worker starts with (malloc on huge pages).

Importing torch costs the launcher ~1.3 s of CPU before it can start a single child, on every `rollbus serve`:
with a CPU-only torch build (its torch/version.py names no CUDA, ROCm or XPU toolkit) and no torch_npu, the
platform is the CPU whatever torch would say, so it is read from that file. Anywhere else the answer comes
from ascend_ops.platform.current_platform(), which the workers use too, so the two cannot disagree.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

DEVICE_ENV = "ROLLBUS_DEVICE"  # cpu | cuda | npu: forces the platform (ascend_ops.platform.current_platform)
_ACCELERATOR_BUILDS = ("cuda", "hip", "xpu")  # torch/version.py fields naming the toolkit a build targets


def torch_build_targets() -> dict[str, str | None] | None:
    """The toolkits the installed torch was built for ({"cuda": "12.8" | None, "hip": ..., "xpu": ...}), read
    from torch/version.py without importing torch; None when it cannot be read (no torch, an unusual file)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, StopIteration):
        return None
    found: dict[str, str | None] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in _ACCELERATOR_BUILDS and node.value is not None:
            try:
                found[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return None  # computed at import: only torch itself can say
    return found if set(found) == set(_ACCELERATOR_BUILDS) else None


def cpu_only_host(environ=os.environ) -> bool:
    """True when the workers will certainly run on the CPU: ROLLBUS_DEVICE=cpu, or no torch_npu and a torch
    built for no accelerator. False means only torch can tell (it may still be the CPU)."""
    forced = environ.get(DEVICE_ENV, "").lower()
    if forced:
        return forced == "cpu"
    if importlib.util.find_spec("torch_npu") is not None:
        return False
    targets = torch_build_targets()
    return targets is not None and not any(targets.values())


_PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")
HUGE_PAGES_ENV = "ROLLBUS_CPU_HUGE_PAGES"  # 0: leave glibc's malloc on 4 KiB pages
HUGETLB_TUNABLE = "glibc.malloc.hugetlb"


def allocator_preloaded(env) -> bool:
    """tcmalloc / jemalloc / mimalloc in LD_PRELOAD (a dict or os.environ): the user chose the allocator."""
    return any(name in env.get("LD_PRELOAD", "") for name in _PRELOADED)


def huge_pages_env(env: dict[str, str]) -> dict[str, str]:
    """What a CPU worker's environment gains so glibc's malloc backs the heap and its large blocks with
    transparent huge pages (the weights and their packed copies): `GLIBC_TUNABLES` with
    glibc.malloc.hugetlb=1, after any tunables the user set. A tunable read at exec, so the launcher sets
    it for the workers it starts (honcho: .env, as the Procfile says). Measured on SmolLM2-135M's layer GEMMs, fp32,
    1 thread, weights streamed from memory as in a decode step: 5-6% faster at 32-64 rows (fewer TLB misses;
    the same products on 4 KiB pages in the same process). Nothing when the user chose: a hugetlb tunable
    already set, ROLLBUS_CPU_HUGE_PAGES=0, or tcmalloc / jemalloc / mimalloc in LD_PRELOAD."""
    value = env.get(HUGE_PAGES_ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV} must be 0 or 1, got {value!r}")
    tunables = env.get("GLIBC_TUNABLES", "")
    if value == "0" or HUGETLB_TUNABLE in tunables or allocator_preloaded(env):
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{HUGETLB_TUNABLE}=1" if tunables else f"{HUGETLB_TUNABLE}=1"}
