"""CPU workers tune glibc's malloc at start (ascend_ops.platform.tune_host_allocator) so a step's buffers are
reused between steps instead of being mapped and page-faulted in anew each time. Each case runs in a fresh
interpreter: the settings are process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_ops.platform import transparent_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# Where a fresh 16 MiB tensor lives (glibc's default threshold, 128 KiB, maps it on its own; tuned, the heap
# serves it), then a decode step's sampling buffers for 20 rounds (64 rows of logits over a 49k vocabulary,
# their log_softmax and exp: 12.6 MB each) and the page faults of the last 10 rounds.
PROBE = """
import json, resource, sys, torch
from ascend_ops.platform import tune_host_allocator
mode = tune_host_allocator() if sys.argv[1] == "tuned" else None
def in_heap(addr):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if a <= addr < b:
                return True
    return False
heap = in_heap(torch.empty(4 << 20).data_ptr())
x, w = torch.randn(64, 576), torch.randn(49152, 576)
for r in range(20):
    if r == 10:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = x @ w.T
    probs = torch.log_softmax(logits, -1).exp()
    del logits, probs
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"mode": mode, "heap": heap, "faults": faults}))
"""


def probe(mode: str, **env: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, "PYTHONPATH": root, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_allocator_serves_step_buffers_from_the_heap_and_keeps_them():
    with ThreadPoolExecutor(2) as pool:  # two interpreters side by side: each counts its own faults
        plain, tuned = pool.map(probe, ("plain", "tuned"))
    assert plain["heap"] is False  # glibc's default: a mapping of its own, faulted in on first use
    assert tuned["mode"] == "glibc (mmap threshold 32 MiB, trim threshold 512 MiB)", tuned
    assert tuned["heap"] is True, tuned
    # (untuned, this loop faults ~9,000 pages in again per round on some runs, none on others: glibc's own
    # threshold moves with what was freed before; tuned it never does)
    assert tuned["faults"] < 200, tuned


def test_the_users_malloc_settings_are_left_alone():
    got = probe("tuned", MALLOC_TRIM_THRESHOLD_="1000000")
    assert got["mode"] == "glibc (MALLOC_TRIM_THRESHOLD_ from the environment)", got
    assert got["heap"] is False, got


# --- huge pages (ascend_ops.host_env.huge_pages_env / host_huge_pages) --------------------------------------

def test_workers_get_the_hugetlb_tunable_unless_the_user_chose():
    from ascend_ops.host_env import huge_pages_env

    assert huge_pages_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # the user's other tunables are kept, ahead of ours
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}  # their choice wins
    assert huge_pages_env({"ROLLBUS_CPU_HUGE_PAGES": "0"}) == {}
    assert huge_pages_env({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}) == {}
    with pytest.raises(ValueError, match="ROLLBUS_CPU_HUGE_PAGES must be 0 or 1, got 'yes'"):
        huge_pages_env({"ROLLBUS_CPU_HUGE_PAGES": "yes"})


def test_the_worker_launcher_env_carries_it_on_cpu_only():
    from bus.topology import Topology
    from engine.launcher import worker_env

    env = worker_env(Topology(), {"PATH": "/bin"}, "cpu")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == "/bin"
    assert worker_env(Topology(), {"PATH": "/bin"}, "cuda") == {"PATH": "/bin"}


# 96 MiB of packed weights as a worker makes them (oneDNN reorders through torch's allocator), with the
# worker's malloc settings; how much of the process is on huge pages after.
HUGE_PROBE = """
import json, torch
from ascend_ops.platform import host_huge_pages, tune_host_allocator, _proc_bytes
tune_host_allocator()
ws = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(3072, 576)) for _ in range(14)]
print(json.dumps({"huge": _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages"), "report": host_huge_pages()}))
"""


@pytest.mark.skipif(transparent_huge_pages() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_the_tunable_puts_packed_weights_on_huge_pages():
    from ascend_ops.host_env import huge_pages_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
            and not k.startswith("MALLOC_")}

    def run(env: dict) -> dict:
        out = subprocess.run([sys.executable, "-c", HUGE_PROBE], env={**base, "PYTHONPATH": root, **env},
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = run(huge_pages_env({}))
    assert got["huge"] >= 64 << 20, got  # most of the 96 MiB (the heap's unaligned ends stay on 4 KiB pages)
    assert got["report"].startswith("glibc glibc.malloc.hugetlb=1, transparent huge pages"), got
    if transparent_huge_pages() == "madvise":  # without the tunable nothing asks for them
        plain = run({})
        assert plain["huge"] < 8 << 20, plain
        assert plain["report"].startswith("malloc on 4 KiB pages"), plain
