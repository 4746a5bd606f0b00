"""Metadata operations of one check run side by side where the file system gains: on a parallel file system
each stat or open is a round trip to a metadata server (0.1-1 ms), and the server answers many at once; on a
local disk or a warm cache the calls hardly wait, and threads would only take turns at the interpreter."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

WORKERS = 64  # requests in flight: what a parallel file system's client sustains without queueing
_INLINE = 32  # the first calls run in the calling thread: fewer items than this never start threads
_WAITING = 20e-6  # seconds a call waits beyond its own CPU time, on average, before threads are worth it


def each(function: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
    """``[function(item) for item in items]``, in order. The first _INLINE calls run here; when they waited
    on the file system (wall time above this thread's CPU time), the rest run over up to WORKERS threads each
    taking a contiguous slice (one task per thread, not per item). The first exception raised is raised."""
    items = list(items)
    wall, cpu = time.perf_counter(), time.thread_time()
    results = [function(item) for item in items[:_INLINE]]
    rest = items[_INLINE:]
    waited = (time.perf_counter() - wall) - (time.thread_time() - cpu)
    if len(rest) < 2 or waited < _WAITING * _INLINE:
        return results + [function(item) for item in rest]
    workers = min(WORKERS, len(rest) // 2)
    bounds = [len(rest) * part // workers for part in range(workers + 1)]
    with ThreadPoolExecutor(workers, thread_name_prefix="ft-ckpt-check") as pool:
        parts = [pool.submit(lambda lo, hi: [function(item) for item in rest[lo:hi]], lo, hi)
                 for lo, hi in zip(bounds, bounds[1:])]
        return results + [result for part in parts for result in part.result()]
