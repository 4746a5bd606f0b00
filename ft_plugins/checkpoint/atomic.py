"""One way to write a file that readers see whole or not at all, for every commit record and dump.

Write beside the target under a name unique to this host, process and thread (many nodes may write
the same file on a shared file system), flush, fsync, rename over the
target, and on request fsync the directory so the rename itself survives a crash. On any error the
temporary file goes and the target is untouched. A write that races a clock (the dying gasp) skips the
fsyncs: the rename alone makes it whole to every reader once its writer is killed (the kernel still holds and
writes back what a killed process wrote); :func:`sync_file_system` makes it survive a node's crash afterwards.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import threading
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterator


def fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_file_system(path: str) -> None:
    """Put everything written to the file system that holds ``path`` (files, renames, directories) on its disk, and
    wait for it: Linux ``syncfs``; where there is none, ``sync`` (every file system)."""
    syncfs = _syncfs()
    if syncfs is None:
        os.sync()
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        if syncfs(descriptor) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), path)
    finally:
        os.close(descriptor)


@functools.lru_cache(maxsize=None)
def _syncfs() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = (ctypes.c_int,), ctypes.c_int
    return function


@contextmanager
def atomic_file(path: str, mode: str = "w", sync_directory: bool = False, durable: bool = True) -> Iterator[IO[Any]]:
    """``with atomic_file(path) as handle: ...`` writes ``path`` atomically (``mode`` "w" text, "wb" bytes);
    ``durable=False``: no fsync (a crash of the node may lose it until :func:`sync_file_system`)."""
    temporary = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(temporary, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    if sync_directory and durable:
        fsync_directory(os.path.dirname(os.path.abspath(path)))
