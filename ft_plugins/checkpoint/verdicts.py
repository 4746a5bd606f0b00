"""A checkpoint's verdict: found intact by a full check, remembered inside it so that a restart re-reads
one small file and stats the files instead of probing and digesting them again.

The verdict holds a fingerprint of every file the check read (each file's name, size, mtime, ctime and
inode, and which were absent, e.g. a manifest not yet written), taken before the check and again after
it: it is recorded only when the two agree, and counts only while the files still match it. Any change
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


def _state(path: str) -> list[int] | None:
    """What identifies one state of a file; None when absent. A file that cannot be stat-ed gets a
    state no recorded one has, so it never matches."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return [-1]
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]


def fingerprint(directory: str, paths: Iterable[str]) -> str:
    """A digest of the covered files' names (relative to ``directory``) and states, stat-ed side by side."""
    ordered = sorted(set(paths))
    states = each(_state, ordered)
    named = [[os.path.relpath(path, directory), state] for path, state in zip(ordered, states)]
    return hashlib.blake2b(json.dumps(named).encode(), digest_size=20).hexdigest()


def recall(directory: str, paths: Iterable[str], deep: bool) -> bool:
    """Whether ``directory`` holds a verdict of this version, as deep as asked, for exactly these files
    in exactly their present state."""
    try:
        recorded = read_json(os.path.join(directory, VERDICT_FILE), _LIMIT)
    except (OSError, ValueError):
        return False
    if not (isinstance(recorded, dict) and recorded.get("version") == VERSION
            and isinstance(recorded.get("fingerprint"), str) and (recorded.get("deep") is True or not deep)):
        return False
    return recorded["fingerprint"] == fingerprint(directory, paths)


def record(directory: str, paths: Iterable[str], deep: bool, before: str) -> None:
    """Remember that the files, fingerprinted ``before`` the check found them intact, still are as they
    were; nothing when one changed meanwhile or the directory is read-only (the next check is full)."""
    after = fingerprint(directory, paths)
    if after != before:
        return
    try:
        with atomic_file(os.path.join(directory, VERDICT_FILE)) as handle:
            json.dump({"version": VERSION, "deep": deep, "fingerprint": after}, handle)
    except OSError as exc:
        log.debug("no verdict recorded in %s: %s", directory, exc)
