"""What a fleet actor needs for the process it starts (engine.fleet.skyrl_actor, engine.fleet.ray_executor).
Standard library only: SkyRL's actor runs in a Python that has Ray but not rollbus's dependencies."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the thread that started it ends (Linux PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def has_accelerator() -> bool:
    """This node has an accelerator device (ROLLBUS_DEVICE forces the answer: "cpu" means none)."""
    forced = os.environ.get("ROLLBUS_DEVICE", "").lower()
    if forced:
        return forced not in ("cpu",)
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/davinci0", "/dev/davinci_manager"))
