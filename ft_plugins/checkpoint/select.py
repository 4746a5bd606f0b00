"""Choose the newest intact checkpoint of a save directory, or judge one checkpoint.

A checkpoint is intact when every file its layout requires is present for every rank the run had
(compared with its neighbouring checkpoint), non-empty, structurally sound (:mod:`.probes`), and
matches its commit manifests (:mod:`.manifest`; one per checkpoint directory, one per rank for
MindSpore's per-rank files) when ft_plugins wrote them. A checkpoint missing one while an older one
is committed is an unfinished save (the run commits, and this save did not finish on every rank).
Candidates are examined newest first and the search stops at the first intact one, so the cost
grows with the candidates examined.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from ft_plugins.checkpoint.distcp import MetadataWalk
from ft_plugins.checkpoint.errors import CheckpointError
from ft_plugins.checkpoint.layouts import FORMATS, Candidate, Layout, detect
from ft_plugins.checkpoint.manifest import (content_problems, is_dump, listed_files, manifest_or_problem,
                                            size_problems)
from ft_plugins.checkpoint.parallel import each, side_by_side
from ft_plugins.checkpoint.probes import probe, walked
from ft_plugins.checkpoint.verdicts import Snapshot, recall, record, recorded

_COMMITTED_LOOKBACK = 3


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str
    unfinished: bool = False  # a save that never finished: never a reason to refuse a start


@dataclass(frozen=True)
class Selection:
    """The chosen checkpoint (``path`` None when none is intact) and every newer one passed over."""

    path: str | None
    iteration: int | None
    format: str | None
    skipped: list[Skipped]
    epoch: int | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "iteration": self.iteration, "format": self.format,
                               "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped]}
        if self.epoch is not None or self.step is not None:
            out.update(epoch=self.epoch, step=self.step)
        return out


@dataclass(frozen=True)
class Verdict:
    path: str
    format: str | None
    intact: bool
    reasons: list[str] = field(default_factory=list)


def _entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no such directory; give the save directory "
                              "(the --save / --load path or the checkpoint output directory)") from None
    except NotADirectoryError:
        raise CheckpointError(f"{directory}: not a directory; give the save directory, "
                              "or use 'ft-plugins ckpt verify' for a single checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot be read ({exc.strerror}); check its permissions") from None


class _Examiner:
    """Checks the candidates of one scan, caching each candidate's file listing for its neighbours."""

    def __init__(self, layout: Layout, candidates: list[Candidate], deep: bool) -> None:
        self.layout = layout
        self.candidates = candidates
        self.deep = deep
        self._contents: dict[int, tuple[dict[str, str], list[str]] | None] = {}
        self._has_manifest: dict[int, bool] = {}

    def contents(self, index: int) -> tuple[dict[str, str], list[str]] | None:
        if index not in self._contents:
            try:
                self._contents[index] = self.layout.contents(self.candidates[index])
            except OSError:
                self._contents[index] = None
        return self._contents[index]

    def _neighbour(self, index: int) -> int | None:
        """The next older regular candidate, else the next newer one: the run's reference shape."""
        order = itertools.chain(range(index + 1, len(self.candidates)), range(index - 1, -1, -1))
        return next((i for i in order if not self.candidates[i].rejected), None)

    def _older_committed(self, index: int) -> bool:
        """Whether one of the nearest older checkpoints of this run is committed (the run uses the commit
        protocol); a few suffice, so the cost does not grow with the history."""
        return any(self.committed(i) for i in range(index + 1, min(index + 1 + _COMMITTED_LOOKBACK,
                                                                      len(self.candidates))))

    def committed(self, index: int) -> bool:
        """Whether the candidate's manifests are all written."""
        if index not in self._has_manifest:
            manifests = self.candidates[index].manifests
            self._has_manifest[index] = bool(manifests) and all(os.path.exists(path) for path, _ in manifests)
        return self._has_manifest[index]

    def problems(self, index: int) -> list[str]:
        candidate = self.candidates[index]
        if candidate.rejected:
            return [candidate.rejected]
        listed = self.contents(index)
        if listed is None:
            return ["cannot be listed (removed or unreadable)"]
        files, problems = listed
        manifest_found, uncommitted, probe_found = self._file_problems(candidate, files)
        problems = [*problems, *manifest_found]
        if uncommitted or not candidate.manifests:
            neighbour = self._neighbour(index)
            reference = self.contents(neighbour) if neighbour is not None else None
            if reference is not None:
                other = os.path.basename(self.candidates[neighbour].path)
                problems += [f"{role} missing (present in {other}, same run)"
                             for role in sorted(set(reference[0]) - set(files))]
        problems += probe_found
        if not problems and uncommitted and self._older_committed(index):
            what = ("no manifest" if len(uncommitted) == len(candidate.manifests)
                    else f"no {', '.join(uncommitted)} (the other ranks committed)")
            problems.append(f"uncommitted: {what}, while older checkpoints of this run are committed "
                            "(the save did not finish on every rank)")
        return problems

    def _file_problems(self, candidate: Candidate, files: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
        """``(manifest problems, manifests not written, probe problems)`` of the candidate's own files; where
        the layout keeps verdicts, a recorded verdict (intact or damaged) that still matches the files stands for the
        checks. A dying-gasp dump is checked deep (every archive member's CRC): it was committed before its data
        reached the disk, and a node crash can bring a file back at its size with zeros where its head and tail are
        not."""
        manifests = {manifest: manifest_or_problem(manifest) for manifest, _ in candidate.manifests}
        deep = self.deep or any(is_dump(found) for found in manifests.values())
        if not self.layout.keeps_verdicts:
            return self._checked(candidate, files, manifests, os.stat, deep)
        snapshot = Snapshot(candidate.path, (manifest for manifest, _ in candidate.manifests))
        verdict = recorded(candidate.path)
        with _walks_begun(snapshot, files.values() if verdict is None else ()) as walks:
            snapshot.add([*files.values(), *(path for manifest, base in candidate.manifests
                                             for path in listed_files(manifests[manifest], base))])
            recalled = recall(snapshot, deep, verdict)
            if recalled is not None:
                return recalled.manifest, [_whose(candidate, base) + os.path.basename(manifest)
                                           for manifest, base in candidate.manifests if manifests[manifest] is None], \
                    recalled.probes
            found = self._checked(candidate, files, manifests, snapshot.stat, deep, walks)
        record(snapshot, deep, found[0], found[2])
        return found

    def _checked(self, candidate: Candidate, files: dict[str, str], manifests: dict[str, dict[str, Any] | str | None],
                 stat_of: Callable[[str], os.stat_result], deep: bool,
                 walks: Mapping[str, MetadataWalk] = {}) -> tuple[list[str], list[str], list[str]]:  # noqa: B006
        """The full check: each manifest compared with the files' stats, then, unless that found damage, their
        content (read side by side with the probes of every file); once damage is found, only the damaged
        files are probed: a damaged newest costs its stats. Kinds and sizes by ``stat_of``; ``walks``: those of
        ``.metadata`` files begun already."""
        sized = {manifest: size_problems(manifests[manifest], base, stat_of) for manifest, base in candidate.manifests}
        probed = lambda chosen: each(lambda path: probe(path, deep, stat_of, walks.get(path)),  # noqa: E731
                                     chosen.values())
        read = lambda: {manifest: content_problems(sized[manifest], base, deep)  # noqa: E731
                        for manifest, base in candidate.manifests if sized[manifest]}
        if any(found and found.problems for found in sized.values()):
            damaged = {path for found in sized.values() if found for path in found.damaged}
            files = {role: path for role, path in files.items() if path in damaged}
            contents, reasons = read(), probed(files)
        elif any(found and found.unread for found in sized.values()):
            contents, reasons = side_by_side(read, lambda: probed(files))
            if any(contents.values()):  # refused by content: no file is damaged by its stats, none is probed
                files = {}
        else:
            contents, reasons = {}, probed(files)
        manifest_found, uncommitted = [], []
        for manifest, base in candidate.manifests:
            whose = _whose(candidate, base)
            if sized[manifest] is None:
                uncommitted.append(f"{whose}{os.path.basename(manifest)}")
            else:
                manifest_found += [f"{whose}{problem}" for problem in (*sized[manifest].problems,
                                                                       *contents.get(manifest, ()))]
        return manifest_found, uncommitted, [f"{role}: {reason}" for role, reason in zip(files, reasons) if reason]


@contextlib.contextmanager
def _walks_begun(snapshot: Snapshot, paths: Iterable[str]) -> Iterator[dict[str, MetadataWalk]]:
    """The walks of the ``.metadata`` files among ``paths`` begun now, each after its stat (the snapshot's, taken
    before the file is read), so that they run beside the stats and reads of the rest of the check; a walk that
    no probe finished is ended on exit."""
    walks: dict[str, MetadataWalk] = {}
    with contextlib.ExitStack() as stack:
        for path in filter(walked, paths):
            snapshot.add([path])
            with contextlib.suppress(OSError):  # its probe says why it cannot be read
                walks[path] = stack.enter_context(MetadataWalk(path))
        yield walks


def _whose(candidate: Candidate, base: str) -> str:
    """How reasons name whose manifest it is: its directory's name where each rank has its own, else nothing."""
    return f"{os.path.basename(base)}/" if len(candidate.manifests) > 1 else ""


class Search:
    """The candidates of one save directory, newest first, each checked only when the search reaches it."""

    def __init__(self, directory: str | os.PathLike[str], format: str = "auto", rank: int | None = None,
                 deep: bool = False) -> None:
        if format not in FORMATS:
            raise CheckpointError(f"unknown checkpoint format {format!r}; use one of {', '.join(FORMATS)}")
        if rank is not None and (type(rank) is not int or rank < 0):
            raise CheckpointError(f"rank {rank!r} is not a rank: give a number from 0 (or none)")
        root = os.fspath(directory)
        entries = _entries(root)
        self.layout = detect(entries, format)
        self.format = self.layout.name if self.layout is not None else None if format == "auto" else format
        scan = self.layout.scan(root, entries, rank) if self.layout is not None else None
        self.candidates = scan.candidates if scan is not None else []
        self.skipped = [Skipped(path, reason) for path, reason in scan.notes] if scan is not None else []
        self.examiner = _Examiner(self.layout, self.candidates, deep) if self.layout is not None else None
        self.index = 0
        self.offered: str | None = None  # the intact one the last call gave

    def next_intact(self, at_most: tuple[int, int, int] | None = None, why: str = "") -> Selection:
        """The newest intact candidate not examined yet (of ``order`` at most ``at_most``: newer ones, and the one the
        last call gave, are passed over for ``why``), with every one passed over so far; its ``path`` None when none
        is left."""
        if self.offered is not None:
            self.skipped.append(Skipped(self.offered, why))
            self.offered = None
        while self.index < len(self.candidates):
            index, candidate = self.index, self.candidates[self.index]
            self.index += 1
            if at_most is not None and order(self.layout.details(candidate)) > at_most:
                self.skipped.append(Skipped(candidate.path, why))
                continue
            problems = self.examiner.problems(index)
            if not problems:
                chosen = self.layout.details(candidate)
                self.offered = chosen.path
                return Selection(chosen.path, chosen.iteration, self.layout.name, list(self.skipped), chosen.epoch,
                                 chosen.step)
            cut_short = candidate.never_committed if candidate.never_committed and not self.examiner.committed(
                index) else None
            reasons = [*problems, cut_short] if cut_short else problems
            self.skipped.append(Skipped(candidate.path, "; ".join(reasons), candidate.unfinished or bool(cut_short)))
        return Selection(None, None, self.format, list(self.skipped))


def order(selection: Any) -> tuple[int, int, int]:
    """Where a checkpoint stands among its directory's (iteration, epoch, step; -1 where it has none)."""
    return tuple(-1 if value is None else int(value)  # type: ignore[return-value]
                 for value in (selection.iteration, selection.epoch, selection.step))


def find_latest(directory: str | os.PathLike[str], format: str = "auto", rank: int | None = None,
                deep: bool = False) -> Selection:
    """The newest intact checkpoint in a save directory, and every newer candidate skipped with its reason.

    ``rank`` picks that rank's file in per-rank layouts (mindspore, mindformers); every rank gets the
    same epoch/step. Raises CheckpointError for an unreadable directory or an unknown format.
    """
    return Search(directory, format, rank, deep).next_intact()


def verify(path: str | os.PathLike[str], deep: bool = False) -> Verdict:
    """Check one checkpoint (a checkpoint directory, or a per-rank ``.ckpt`` file) in the context of
    its save directory; a lone file of another kind gets its structural probe only."""
    target = os.path.abspath(os.fspath(path))
    if not os.path.exists(target):
        raise CheckpointError(f"{target}: no such file or directory")
    parent = os.path.dirname(target)
    for root in (parent, os.path.dirname(parent)):
        try:
            entries = _entries(root)
        except CheckpointError:  # e.g. an unreadable grandparent: judge by what can be read
            continue
        layout = detect(entries, "auto")
        if layout is None:
            continue
        scan = layout.scan(root, entries, None)
        for index, candidate in enumerate(scan.candidates):
            if target == candidate.path or target in candidate.rank_files.values():
                reasons = _Examiner(layout, scan.candidates, deep).problems(index)
                return Verdict(target, layout.name, not reasons, reasons)
    if os.path.isdir(target):
        raise CheckpointError(f"{target}: not a checkpoint of a known layout (iter_*, iteration_*, "
                              "checkpoint-N, rank_*/*.ckpt); use 'ft-plugins ckpt latest' for a save directory")
    reason = probe(target, deep)
    return Verdict(target, None, reason is None, [reason] if reason else [])
