"""A checkpoint's verdict: found intact, or damaged, by a full check, remembered inside it so that a restart
re-reads one small file and stats the files instead of probing and digesting them again (a damaged newest,
say one Megatron wrote alone that lost a file, would otherwise be walked again at every start while it stays).

The verdict holds a fingerprint of every file the check read (each file's name, size, mtime, ctime and
inode, and which were absent, e.g. a manifest not yet written), of the one stat of each taken before the
check read any of them (:class:`Snapshot`), and counts only while the files still match it. Any change
to any covered file (rewritten, truncated, touched, replaced, removed or added to the listing) makes it
count for nothing, as do a verdict of another version of these checks, a fast verdict for a deep check,
and a verdict that cannot be read; the full check then runs again. It never makes a file look intact
that the full check did not find intact in the very state it is in. A damaged verdict is kept only for damage
the files themselves hold (never a read error, which may pass), covers every path the check stat-ed (a file a
``.metadata`` names that was missing then is covered as absent), and serves a check as deep as its own or deeper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ft_plugins.checkpoint.atomic import atomic_file
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import read_json

VERDICT_FILE = "ft_verdict.json"
VERSION = 2  # raise whenever a check grows stricter: every older verdict then counts for nothing
_LIMIT = 64 << 10
TRANSIENT = "unreadable"  # what a reason born of a read error says: such damage is never remembered

log = logging.getLogger(__name__)


class Snapshot:
    """One stat of every file a check covers, each taken before the file is read, side by side. The check
    takes kinds and sizes from it and the verdict fingerprints it, so the verdict is of exactly the states
    the check saw: a file changed after its stat no longer matches it, and one changed before was read as
    it is now (changes within one tick of the file system's clock stay unseen, as they would by any stat)."""

    def __init__(self, directory: str, paths: Iterable[str] = ()) -> None:
        self.directory = directory
        self._status: dict[str, os.stat_result | OSError] = {}
        self.beyond: set[str] = set()  # paths the check stat-ed that the snapshot was not given
        self.add(paths)

    def add(self, paths: Iterable[str]) -> None:
        """Stat the paths not covered yet (a manifest is covered before it is read, what it lists after)."""
        new = sorted(set(paths) - self._status.keys())
        self._status.update(zip(new, each(_status, new)))

    def stat(self, path: str) -> os.stat_result:
        """``os.stat(path)`` as the snapshot took it; a path it does not cover is stat-ed now, and covered."""
        if path not in self._status:
            self._status[path] = _status(path)
            self.beyond.add(path)
        status = self._status[path]
        if isinstance(status, OSError):
            raise type(status)(status.errno, status.strerror, status.filename)
        return status

    def relative(self, path: str) -> str:
        inside = self.directory + os.sep
        return path[len(inside):] if path.startswith(inside) else os.path.relpath(path, self.directory)

    def fingerprint(self) -> str:
        """A digest of the covered files' names (relative to the directory) and states."""
        named = [[self.relative(path), _state(self._status[path])] for path in sorted(self._status)]
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


@dataclass(frozen=True)
class Recalled:
    """A verdict that still stands: intact when both lists are empty, else the damage the check found."""

    manifest: list[str] = field(default_factory=list)  # what does not match the manifests
    probes: list[str] = field(default_factory=list)  # what the files' own probes found

    @property
    def intact(self) -> bool:
        return not self.manifest and not self.probes


def recorded(directory: str) -> dict[str, Any] | None:
    """The directory's verdict of this version, as written, unless it cannot be read or is of another shape. Read
    before the check stats the files: none recorded, the check can begin its slow parts at once."""
    try:
        found = read_json(os.path.join(directory, VERDICT_FILE), _LIMIT)
    except (OSError, ValueError):
        return None
    if not (isinstance(found, dict) and found.get("version") == VERSION
            and isinstance(found.get("fingerprint"), str) and isinstance(found.get("deep"), bool)):
        return None
    damage = [found.get(name, []) for name in ("manifest", "probes", "beyond")]
    if not all(isinstance(listed, list) and all(isinstance(item, str) for item in listed) for listed in damage):
        return None
    return found


def recall(snapshot: Snapshot, deep: bool, verdict: dict[str, Any] | None) -> Recalled | None:
    """The ``verdict`` (:func:`recorded`) of the snapshot's directory, for exactly these files in exactly their
    present state, where it serves a check this deep (intact: its check was as deep; damaged: its check was no
    deeper); else None."""
    if verdict is None:
        return None
    found = Recalled(verdict.get("manifest", []), verdict.get("probes", []))
    if verdict["deep"] != deep and (verdict["deep"] is False) == found.intact:
        return None
    beyond = [os.path.join(snapshot.directory, name) for name in verdict.get("beyond", [])
              if not os.path.isabs(name) and ".." not in name.split("/")]
    snapshot.add(beyond)
    return found if verdict["fingerprint"] == snapshot.fingerprint() else None


def record(snapshot: Snapshot, deep: bool, manifest: Sequence[str] = (), probes: Sequence[str] = ()) -> None:
    """Remember that the files, in the states of the snapshot taken before the check, were found intact (no
    damage given) or damaged so; nothing for damage a read error may have caused, nor where the directory is
    read-only (the next check is full)."""
    if any(TRANSIENT in reason for reason in (*manifest, *probes)):
        return
    found = {"manifest": list(manifest), "probes": list(probes)} if manifest or probes else {}
    beyond = sorted(snapshot.relative(path) for path in snapshot.beyond)
    try:
        with atomic_file(os.path.join(snapshot.directory, VERDICT_FILE)) as handle:
            json.dump({"version": VERSION, "deep": deep, "fingerprint": snapshot.fingerprint(), **found,
                       **({"beyond": beyond} if beyond else {})}, handle)
    except OSError as exc:
        log.debug("no verdict recorded in %s: %s", snapshot.directory, exc)
