"""Giving freed heap back to the system after a burst or a large request (glibc's malloc_trim).

What a large body costs the gateway while it is parsed (one 32 MB body of token ids: ~5.6 M Python ints,
pydantic's parse buffers; ~300 MB) is freed when the request ends, but glibc keeps it: the freed chunks
sit in its arenas below its (dynamic) trim threshold, so the RSS stays at its peak (measured with
bench/large_request.py: 107 MB -> 405 MB after four such requests, 103 MB after one malloc_trim(0)).
A burst of 1,000 streams leaves ~13 MB the same way. So the gateway calls malloc_trim(0) when such a
peak is over: after a request whose body was large, and when the last of many concurrent generation
requests ends. The call runs on a worker thread (ctypes releases the GIL), at most once per
MIN_INTERVAL_S. Where there is no glibc (musl, macOS), nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger()

LARGE_BODY_BYTES = 1 << 20  # a body this large leaves a heap worth trimming
BURST_REQUESTS = 64  # ... and so do this many concurrent generation requests, once they are all over
MIN_INTERVAL_S = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's (no find_library: it forks)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Asks for a malloc_trim(0) after a peak; a request during a pending trim is merged into it."""

    def __init__(self, open_requests: Callable[[], int], trim: Callable[[int], int] | None = None,
                 min_interval_s: float = MIN_INTERVAL_S):
        """`open_requests`: the generation requests in flight now; `trim` malloc_trim (None: glibc's)."""
        self.open_requests = open_requests
        self.trim = trim if trim is not None else _malloc_trim()
        self.min_interval_s = min_interval_s
        self.peak_requests = 0  # the most concurrent generation requests since the last trim
        self.trims = 0
        self._last = 0.0
        self._pending: asyncio.Task | None = None

    def started(self) -> None:
        """A generation request began."""
        self.peak_requests = max(self.peak_requests, self.open_requests())

    def ended(self, body_bytes: int) -> None:
        """A request ended; its body had `body_bytes`."""
        if body_bytes >= LARGE_BODY_BYTES or (self.open_requests() == 0 and self.peak_requests >= BURST_REQUESTS):
            self.request()

    def request(self) -> None:
        if self.trim is None or (self._pending is not None and not self._pending.done()):
            return
        self._pending = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        wait = self._last + self.min_interval_s - time.monotonic()
        await asyncio.sleep(max(wait, 0.05))  # let the request's last references go first
        self.peak_requests = self.open_requests()
        t0 = time.monotonic()
        await asyncio.to_thread(self.trim, 0)  # type: ignore[arg-type]
        self._last = time.monotonic()
        self.trims += 1
        log.debug("gateway.heap_trimmed", seconds=round(self._last - t0, 4))
