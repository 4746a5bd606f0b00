"""What every layout shares: candidates, a scan's result, the :class:`Layout` interface, safe listing.

A layout turns a save directory into candidates, newest first, from directory and file names
alone; :meth:`Layout.contents` then lists one candidate's files by *role* (a name that is the
same for every checkpoint of a run, e.g. ``mp_rank_01/model_optim_rng.pt``) so that a candidate
can be compared with its neighbour and each file probed. Nothing here opens a file except the
small text/JSON files a layout uses as pointers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.checkpoint.naming import TRACKER, Tracker, read_tracker

SMALL_JSON = 1 << 20  # pointer and config files are a few hundred bytes; never read more


@dataclass
class Candidate:
    """One checkpoint: ``key`` orders candidates (largest = newest); ``rejected`` is set when its name
    alone rules it out (a dying-gasp temporary, a breakpoint file, one marked unhealthy)."""

    path: str
    key: tuple[int, ...]
    iteration: int | None = None
    epoch: int | None = None
    step: int | None = None
    rejected: str | None = None
    # a save that never finished (a dump in progress, a tmp-checkpoint never renamed): not a checkpoint at all
    unfinished: bool = False
    # why the candidate, found damaged, is no checkpoint either (nothing committed it), unless its manifest exists
    never_committed: str | None = None
    manifests: list[tuple[str, str]] = field(default_factory=list)  # (manifest, directory its paths are relative to)
    rank_files: dict[int, str] = field(default_factory=dict)


@dataclass
class Scan:
    """A layout's reading of one save directory: candidates newest first, plus pointer problems
    (a tracker naming a missing iteration, a garbage tracker) reported as skipped entries."""

    candidates: list[Candidate]
    notes: list[tuple[str, str]] = field(default_factory=list)


def listdir(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as entries:
        return list(entries)


def is_kind(entry: os.DirEntry, kind: str) -> bool:
    """``entry.is_dir()`` / ``is_file()``, False for what cannot be resolved (a symlink loop, a dangling link)."""
    try:
        return getattr(entry, kind)()
    except OSError:
        return False


def mtime(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return -1


def dirs(entries: list[os.DirEntry]) -> list[os.DirEntry]:
    return [entry for entry in entries if is_kind(entry, "is_dir")]


def tracker_of(root: str, scan: Scan) -> Tracker:
    """The save directory's tracker; an unusable one is noted in the scan (checkpoints then chosen by name)."""
    tracker = read_tracker(root)
    if tracker.problem:
        scan.notes.append((os.path.join(root, TRACKER), f"{tracker.problem}; ignored, checkpoints chosen "
                                                          "by their directories"))
    return tracker


def manifest_inside(directory: str) -> list[tuple[str, str]]:
    """The single manifest of a directory-style checkpoint (written after every rank finished)."""
    return [(os.path.join(directory, MANIFEST), directory)]


class Layout:
    name = ""
    # whether a candidate found intact keeps its verdict inside it (:mod:`..verdicts`): directories whose
    # contents the layout names exactly, so that the verdict file is never taken for a checkpoint file
    keeps_verdicts = False

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        raise NotImplementedError

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        """``({role: path}, problems)`` for the files this candidate must hold."""
        raise NotImplementedError

    def details(self, candidate: Candidate) -> Candidate:
        """Fill in what only the chosen candidate needs (epoch/step read from a small JSON)."""
        return candidate
