"""CPU workers tune glibc's malloc at start (ascend_ops.platform.tune_host_allocator) so a step's buffers are
reused between steps instead of being mapped and page-faulted in anew each time. Each case runs in a fresh
interpreter: the settings are process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
    assert probe("plain")["heap"] is False  # glibc's default: a mapping of its own, faulted in on first use
    tuned = probe("tuned")
    assert tuned["mode"] == "glibc (mmap threshold 32 MiB, trim threshold 512 MiB)", tuned
    assert tuned["heap"] is True, tuned
    # (untuned, this loop faults ~9,000 pages in again per round on some runs, none on others: glibc's own
    # threshold moves with what was freed before; tuned it never does)
    assert tuned["faults"] < 200, tuned


def test_the_users_malloc_settings_are_left_alone():
    got = probe("tuned", MALLOC_TRIM_THRESHOLD_="1000000")
    assert got["mode"] == "glibc (MALLOC_TRIM_THRESHOLD_ from the environment)", got
    assert got["heap"] is False, got
