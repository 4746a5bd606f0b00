"""Metadata operations of one check run side by side: on a parallel file system each stat or open is a
round trip to a metadata server (0.1-1 ms), and the server answers many at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

WORKERS = 64  # requests in flight: what a parallel file system's client sustains without queueing
_INLINE = 32  # fewer items than this run in the calling thread: starting threads would cost more


def each(function: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
    """``[function(item) for item in items]``, in order, over up to WORKERS threads each taking a
    contiguous slice (one task per thread, not per item); the first exception raised is raised."""
    items = list(items)
    if len(items) < _INLINE:
        return [function(item) for item in items]
    workers = min(WORKERS, len(items) // 2)
    bounds = [len(items) * part // workers for part in range(workers + 1)]
    with ThreadPoolExecutor(workers, thread_name_prefix="ft-ckpt-check") as pool:
        parts = [pool.submit(lambda lo, hi: [function(item) for item in items[lo:hi]], lo, hi)
                 for lo, hi in zip(bounds, bounds[1:])]
        return [result for part in parts for result in part.result()]
