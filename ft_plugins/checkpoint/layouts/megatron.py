"""Megatron's layout: ``iter_{:07d}`` directories (naming and tracker: :mod:`ft_plugins.checkpoint.naming`)."""

from __future__ import annotations

import os
import re

from ft_plugins.checkpoint.dump import pending_reason
from ft_plugins.checkpoint.layouts.base import (SMALL_JSON, Candidate, Layout, Scan, dirs, listdir, manifest_inside,
                                                tracker_of)
from ft_plugins.checkpoint.naming import ITERATION_DIR, RELEASE, TRACKER, iteration_dir
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import read_json

_RELEASE_FIRST = 1 << 62  # a release named by the tracker sorts before every iteration


def _never_committed(tracker: int | str | None, iteration: int) -> str | None:
    """Why a periodic save of ``iteration`` was never committed: Megatron moves its tracker once every rank
    saved, so a save the tracker never reached is one cut short (Megatron alone would not load it)."""
    if isinstance(tracker, int) and tracker >= iteration:
        return None
    named = "is absent" if tracker is None else f"names {tracker}"
    return f"never committed ({TRACKER} {named}, no manifest): a save cut short, not a checkpoint"


class Megatron(Layout):
    """``iter_{:07d}/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`` (+ ``distrib_optim.pt``), or a
    ``torch_dist`` directory (``.metadata``, ``metadata.json``, ``*.distcp``, and ``common.pt`` when
    ``metadata.json`` names a ``common_backend``: megatron-core before 0.19 writes it, 0.19 and later keep
    the common state inside the ``.distcp`` files); ``iter_{:07d}_tmp`` is a dying-gasp save still in
    progress; the tracker names the last commit: a damaged save newer than it, without a manifest, is one cut
    short, no reason to refuse a start."""

    name = "megatron"
    keeps_verdicts = True
    ITER = ITERATION_DIR
    RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")
    DIST_REQUIRED = (".metadata", "metadata.json")
    DIST_COMMON = "common.pt"

    @classmethod
    def matches(cls, names: set[str]) -> bool:
        return any(cls.ITER.match(name) for name in names) or RELEASE in names

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        tracker = tracker_of(root, scan).value
        iterations = set()
        for entry in dirs(entries):
            match = self.ITER.match(entry.name)
            if match:
                iteration, temporary = int(match.group(1)), bool(match.group(2))
                candidate = Candidate(entry.path, (iteration, 0 if temporary else 1), iteration,
                                      manifests=manifest_inside(entry.path))
                if temporary:
                    candidate.rejected, candidate.unfinished = pending_reason(entry.path), True
                else:
                    iterations.add(iteration)
                    candidate.never_committed = _never_committed(tracker, iteration)
                scan.candidates.append(candidate)
            elif entry.name == RELEASE:
                top = tracker == RELEASE
                scan.candidates.append(Candidate(entry.path, (_RELEASE_FIRST if top else -1, 1), None,
                                                 manifests=manifest_inside(entry.path)))
        if isinstance(tracker, int) and tracker not in iterations:
            scan.notes.append((iteration_dir(root, tracker), f"named by {TRACKER} but missing"))
        if tracker == RELEASE and not any(c.key[0] == _RELEASE_FIRST for c in scan.candidates):
            scan.notes.append((os.path.join(root, RELEASE), f"named by {TRACKER} but missing"))
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        entries = listdir(candidate.path)
        names = {entry.name for entry in entries}
        if names & {*self.DIST_REQUIRED, self.DIST_COMMON} or any(name.endswith(".distcp") for name in names):
            paths = {entry.name: entry.path for entry in entries}
            required = [*self.DIST_REQUIRED, *sorted(n for n in names if n.endswith(".distcp"))]
            if self.DIST_COMMON in names or self._names_common_backend(os.path.join(candidate.path, "metadata.json")):
                required.append(self.DIST_COMMON)
            files = {name: paths.get(name) or os.path.join(candidate.path, name) for name in required}
            problems = [] if any(name.endswith(".distcp") for name in names) else ["no *.distcp data files"]
            return files, problems
        files = {}
        rank_dirs = [entry for entry in dirs(entries) if self.RANK_DIR.match(entry.name)]
        for rank_dir, listing in zip(rank_dirs, each(listdir, [entry.path for entry in rank_dirs])):
            inner = {entry.name for entry in listing}
            for name in ("model_optim_rng.pt", *sorted(inner & {"distrib_optim.pt"})):
                files[f"{rank_dir.name}/{name}"] = os.path.join(rank_dir.path, name)
        return files, [] if rank_dirs else ["no mp_rank_* directories and no torch_dist files"]

    @staticmethod
    def _names_common_backend(config: str) -> bool:
        """Whether ``metadata.json`` (written last, once every shard is saved) records a separate common
        backend, i.e. a ``common.pt``; an unreadable one is reported by its own probe."""
        try:
            recorded = read_json(config, SMALL_JSON)
        except (OSError, ValueError):
            return False
        return isinstance(recorded, dict) and "common_backend" in recorded

