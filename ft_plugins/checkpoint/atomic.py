"""One way to write a file that readers see whole or not at all, for every commit record and dump.

Write beside the target under a name unique to this host, process and thread (many nodes may write
the same file on a shared file system), flush, fsync, rename over the
target, and on request fsync the directory so the rename itself survives a crash. On any error the
temporary file goes and the target is untouched.
"""

from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from typing import IO, Any, Iterator


def fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def atomic_file(path: str, mode: str = "w", sync_directory: bool = False) -> Iterator[IO[Any]]:
    """``with atomic_file(path) as handle: ...`` writes ``path`` atomically (``mode`` "w" text, "wb" bytes)."""
    temporary = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(temporary, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    if sync_directory:
        fsync_directory(os.path.dirname(os.path.abspath(path)))
