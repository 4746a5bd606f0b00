"""Reading a checkpoint's own small files safely: regular files only, bounded sizes, paths kept inside.

Every probe, the manifest, the tracker and the layouts read through these, so that whatever a file
claims, a read never blocks (a FIFO), never runs forever (``/dev/zero``) and never leaves the checkpoint.
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any

_JSON_LIMIT = 64 << 20  # manifests, indexes, trainer states: far smaller in practice


class NotRegularFile(OSError):
    """A path that is a device, FIFO, socket or directory where a checkpoint file belongs."""


def open_descriptor(path: str, known_regular: bool = False) -> int:
    """A descriptor of ``path`` open for reading only if it is a regular file (a FIFO would block, ``/dev/zero``
    never ends). ``known_regular``: a stat of the caller's just found it so, and the caller reads a bounded
    amount; it is not asked again (one metadata operation less; non-blocking, so a FIFO swapped in since
    reads as empty)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not known_regular and not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_regular(path: str, known_regular: bool = False) -> IO[bytes]:
    """:func:`open_descriptor` as a file object."""
    descriptor = open_descriptor(path, known_regular)
    try:
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_at(descriptor: int, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes from ``offset`` (fewer only at the end of the file): a slice read without a file
    object, whose construction would ask the file system about the file again."""
    parts: list[bytes] = []
    while length > 0:
        part = os.pread(descriptor, length, offset)
        if not part:
            break
        parts.append(part)
        length, offset = length - len(part), offset + len(part)
    return b"".join(parts)


def read_json(path: str, limit: int = _JSON_LIMIT) -> Any:
    """The JSON document in a regular file of at most ``limit`` bytes. Raises OSError when it cannot be
    read and ValueError (with the reason) when it is not such a document."""
    with open_regular(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


def is_inside(relative: object) -> bool:
    """Whether a path recorded in a checkpoint's own files names something inside it (relative, no ``..``)."""
    if not isinstance(relative, str) or not relative or "\0" in relative or os.path.isabs(relative):
        return False
    return not os.path.normpath(relative).startswith(os.pardir)

