"""A checkpoint's verdict: found intact by a full check, remembered inside it so that a restart re-reads
one small file and stats the files instead of probing and digesting them again.

The verdict holds a fingerprint of every file the check read (each file's name, size, mtime, ctime and
inode, and which were absent, e.g. a manifest not yet written), of the one stat of each taken before the
check read any of them (:class:`Snapshot`), and counts only while the files still match it. Any change
to any covered file (rewritten, truncated, touched, replaced, removed or added to the listing) makes it
count for nothing, as do a verdict of another version of these checks, a fast verdict for a deep check,
and a verdict that cannot be read; the full check then runs again. It never makes a file look intact
that the full check did not find intact in the very state it is in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Iterable

from ft_plugins.checkpoint.atomic import atomic_file
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import read_json

VERDICT_FILE = "ft_verdict.json"
VERSION = 1  # raise whenever a check grows stricter: every older verdict then counts for nothing
_LIMIT = 4 << 10

log = logging.getLogger(__name__)


class Snapshot:
    """One stat of every file a check covers, taken side by side before any of them is read. The check
    takes kinds and sizes from it and the verdict fingerprints it, so the verdict is of exactly the states
    the check saw: a file changed after its stat no longer matches it, and one changed before was read as
    it is now (changes within one tick of the file system's clock stay unseen, as they would by any stat)."""

    def __init__(self, directory: str, paths: Iterable[str] = ()) -> None:
        self.directory = directory
        self._status: dict[str, os.stat_result | OSError] = {}
        self.add(paths)

    def add(self, paths: Iterable[str]) -> None:
        """Stat the paths not covered yet (a manifest is covered before it is read, what it lists after)."""
        new = sorted(set(paths) - self._status.keys())
        self._status.update(zip(new, each(_status, new)))

    def stat(self, path: str) -> os.stat_result:
        """``os.stat(path)`` as the snapshot took it; a path it does not cover is stat-ed now."""
        if path not in self._status:
            return os.stat(path)
        status = self._status[path]
        if isinstance(status, OSError):
            raise type(status)(status.errno, status.strerror, status.filename)
        return status

    def fingerprint(self) -> str:
        """A digest of the covered files' names (relative to the directory) and states."""
        inside = self.directory + os.sep
        named = [[path[len(inside):] if path.startswith(inside) else os.path.relpath(path, self.directory),
                  _state(self._status[path])] for path in sorted(self._status)]
        return hashlib.blake2b(json.dumps(named).encode(), digest_size=20).hexdigest()


def _status(path: str) -> os.stat_result | OSError:
    try:
        return os.stat(path)
    except OSError as exc:
        return exc


def _state(status: os.stat_result | OSError) -> list[int] | None:
    """What identifies one state of a file; None when absent. A file that cannot be stat-ed gets a
    state no recorded one has, so it never matches."""
    if isinstance(status, FileNotFoundError):
        return None
    if isinstance(status, OSError):
        return [-1]
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]


def recall(snapshot: Snapshot, deep: bool) -> bool:
    """Whether the snapshot's directory holds a verdict of this version, as deep as asked, for exactly
    these files in exactly their present state."""
    try:
        recorded = read_json(os.path.join(snapshot.directory, VERDICT_FILE), _LIMIT)
    except (OSError, ValueError):
        return False
    if not (isinstance(recorded, dict) and recorded.get("version") == VERSION
            and isinstance(recorded.get("fingerprint"), str) and (recorded.get("deep") is True or not deep)):
        return False
    return recorded["fingerprint"] == snapshot.fingerprint()


def record(snapshot: Snapshot, deep: bool) -> None:
    """Remember that the files, in the states of the snapshot taken before the check, were found intact;
    nothing when the directory is read-only (the next check is full)."""
    try:
        with atomic_file(os.path.join(snapshot.directory, VERDICT_FILE)) as handle:
            json.dump({"version": VERSION, "deep": deep, "fingerprint": snapshot.fingerprint()}, handle)
    except OSError as exc:
        log.debug("no verdict recorded in %s: %s", snapshot.directory, exc)
