"""Linux /proc readings of a process's memory, for tests and benchmarks of sleep mode."""

from __future__ import annotations


def rss(pid: int) -> int:
    """Resident set size in bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def mapping_rss(pid: int, size_bytes: int, tolerance: float = 0.05) -> int:
    """Resident bytes of the largest-resident mapping whose size is within `tolerance` below
    `size_bytes` (how the worker's KV cache, an anonymous mapping of its own, is found)."""
    best, size = 0, None
    for line in open(f"/proc/{pid}/smaps"):
        if line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif line.startswith("Rss:") and size is not None and (1 - tolerance) * size_bytes <= size <= size_bytes:
            best = max(best, int(line.split()[1]) * 1024)
    return best
