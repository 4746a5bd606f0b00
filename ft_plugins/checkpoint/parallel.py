"""Metadata operations of one check run side by side where the file system gains: on a parallel file system
each stat or open is a round trip to a metadata server (0.1-1 ms), and the server answers many at once; on a
local disk or a warm cache the calls hardly wait, and threads would only take turns at the interpreter."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

WORKERS = 32  # requests in flight; more threads only take turns at the interpreter lock (64: twice the CPU)
_PROBE = 8  # calls run here before each look at whether they waited
_INLINE = 32  # at most this many calls run here: fewer items than this never start threads
_WAITING = 20e-6  # seconds a call waits beyond its own CPU time, on average, before threads are worth it


def each(function: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
    """``[function(item) for item in items]``, in order. Calls run here, _PROBE at a time, up to _INLINE; as
    soon as those run so far waited on the file system (wall time above this thread's CPU time), the rest run
    over up to WORKERS threads each taking a contiguous slice (one task per thread, not per item). The first
    exception raised is raised."""
    items = list(items)
    wall, cpu = time.perf_counter(), time.thread_time()
    results: list[Result] = []
    waited = False
    while not waited and len(results) < min(_INLINE, len(items)):
        results += [function(item) for item in items[len(results):len(results) + _PROBE]]
        waited = (time.perf_counter() - wall) - (time.thread_time() - cpu) >= _WAITING * len(results)
    rest = items[len(results):]
    if len(rest) < 2 or not waited:
        return results + [function(item) for item in rest]
    workers = min(WORKERS, len(rest) // 2)
    bounds = [len(rest) * part // workers for part in range(workers + 1)]
    with ThreadPoolExecutor(workers, thread_name_prefix="ft-ckpt-check") as pool:
        parts = [pool.submit(lambda lo, hi: [function(item) for item in rest[lo:hi]], lo, hi)
                 for lo, hi in zip(bounds, bounds[1:])]
        return results + [result for part in parts for result in part.result()]


def side_by_side(here: Callable[[], Result], beside: Callable[[], Item]) -> tuple[Result, Item]:
    """``(here(), beside())``, ``beside`` in a thread of its own: two independent parts of one check, such as
    the ``.metadata`` walk (CPU) and the reading of every file's samples (waits on the file system), take
    as long together as the longer one, not as both."""
    with ThreadPoolExecutor(1, thread_name_prefix="ft-ckpt-check") as pool:
        other = pool.submit(beside)
        return here(), other.result()
