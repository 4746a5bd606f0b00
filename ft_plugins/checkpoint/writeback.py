"""A file's data on its way to the disk while it is still being written, so that its fsync waits for the tail only.

A dump is done when its files are on disk: each ends with an fsync. Written whole into the page cache
first, a file's data would only then start for the disk, and the fsync would wait for all of it. While
:func:`handed_to_disk` is open, a thread watches the file grow and asks the kernel to start writing back
each new chunk (Linux ``sync_file_range``, which does not wait): the disk works while the writer produces
the next chunk. The writer itself is untouched (the same call, the same bytes); where the call is missing
the file is written as before. Framework-neutral.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

CHUNK = 32 << 20  # bytes handed to the disk at a time
POLL = 0.02  # seconds between looks at the file's size
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages, do not wait


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_START_WRITEBACK = _sync_file_range()


@contextmanager
def handed_to_disk(path: str) -> Iterator[None]:
    """While the body writes ``path``, hand each new :data:`CHUNK` of it to the disk."""
    if _START_WRITEBACK is None:
        yield
        return
    done = threading.Event()
    follower = threading.Thread(target=_follow, args=(path, done, _START_WRITEBACK), name="ft-plugins-writeback",
                                daemon=True)
    follower.start()
    try:
        yield
    finally:
        done.set()
        follower.join()


def _follow(path: str, done: threading.Event, start_writeback: Callable[[int, int, int, int], int]) -> None:
    """Until ``done``: start the writeback of what was added to ``path`` since the last time. A help only:
    any error ends it quietly, and the caller's fsync does the rest."""
    descriptor, handed = -1, 0
    try:
        while not done.wait(POLL):
            if descriptor < 0:
                try:
                    descriptor = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # not created yet
            size = os.fstat(descriptor).st_size
            if size - handed >= CHUNK:
                start_writeback(descriptor, handed, size - handed, _SYNC_FILE_RANGE_WRITE)
                handed = size
    except OSError:
        pass
    finally:
        if descriptor >= 0:
            os.close(descriptor)
