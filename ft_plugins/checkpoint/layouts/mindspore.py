"""MindSpore's per-rank ``.ckpt`` files (ModelCheckpoint, MindFormers' CheckpointMonitor) and MindFormers'
newer ``iteration_{:08d}`` layout, with the step a MindSpore file records (read from its protobuf tail)."""

from __future__ import annotations

import io
import logging
import os
import re

from ft_plugins.checkpoint.layouts.base import (SMALL_JSON, Candidate, Layout, Scan, dirs, listdir, manifest_inside,
                                                mtime, tracker_of)
from ft_plugins.checkpoint.manifest import manifest_name
from ft_plugins.checkpoint.naming import TRACKER
from ft_plugins.checkpoint.probes import ProtobufReader
from ft_plugins.checkpoint.reading import open_regular, read_json

log = logging.getLogger("ft_plugins.resume")


class MindSporeFiles(Layout):
    """``[rank_*/]<prefix>-<epoch>_<step>.ckpt`` from ModelCheckpoint; MindFormers' CheckpointMonitor adds
    ``rank_*/meta.json`` and ``health_ckpts.json``. One candidate is one save of every rank.

    Every rank saves its own file, so every rank commits its own: ``rank_*/ft_manifest-<file name>.json``
    beside the file (:func:`rank_file_manifest`). A save is committed when every rank's manifest exists.
    In MindFormers' layout the names do not order the saves (a resumed run restarts its epoch count and
    ModelCheckpoint gives it a new prefix): the step recorded in each file (``step_num``, in the last
    bytes of the file) does; a file whose record is unreadable is examined first, so its damage is reported.
    """

    name = "mindspore"
    CKPT = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)(?P<breakpoint>_breakpoint)?\.ckpt$")
    RANK_DIR = re.compile(r"^rank_(\d+)$")

    def __init__(self, name: str = "mindspore") -> None:
        self.name = name
        self._expected: list[int] = []  # the rank ids of the scanned directory: every candidate needs all

    @classmethod
    def rank_dirs(cls, entries: list[os.DirEntry]) -> dict[int, str]:
        out = {}
        for entry in dirs(entries):
            match = cls.RANK_DIR.match(entry.name)
            if match:
                out[int(match.group(1))] = entry.path
        return out

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        ranks = self.rank_dirs(entries)
        if not ranks:
            ranks = {-1: root}
        elif rank is not None and rank not in ranks:
            ranks[rank] = os.path.join(root, f"rank_{rank}")
        self._expected = sorted(ranks)
        unhealthy = self._unhealthy(root)
        saves: dict[tuple[str, int, int, bool], dict[int, os.DirEntry]] = {}
        for rank_id, directory in ranks.items():
            try:
                files = listdir(directory)
            except OSError:  # absent (a rank that never saved) or unreadable: its files count as missing
                continue
            for entry in files:
                match = self.CKPT.match(entry.name)
                if match:
                    prefix = re.sub(rf"rank_{rank_id}(?=_|$)", "rank_*", match.group("prefix")) if rank_id >= 0 \
                        else match.group("prefix")
                    save = (prefix, int(match.group("epoch")), int(match.group("step")), bool(match.group("breakpoint")))
                    saves.setdefault(save, {})[rank_id] = entry
        wanted = rank if rank in ranks else min(ranks)
        for (prefix, epoch, step, breakpoint), per_rank in saves.items():
            chosen = {r: entry.path for r, entry in per_rank.items()}
            own = per_rank.get(wanted) or next(iter(per_rank.values()))
            path = chosen.get(wanted) or os.path.join(ranks[wanted], f"*-{epoch}_{step}.ckpt")
            candidate = Candidate(path, (), None, epoch, step, rank_files=chosen,
                                  manifests=[((rank_file_manifest(chosen[r]) or "") if r in chosen
                                              else os.path.join(ranks[r], manifest_name(os.path.basename(path))),
                                              ranks[r]) for r in self._expected])
            if self.name == "mindformers":
                candidate.iteration = recorded_step(own.path)
                order = (candidate.iteration is None, candidate.iteration or 0, mtime(own))
            else:
                order = (epoch, step, mtime(own))
            candidate.key = (*order, 0 if breakpoint else 1)
            if breakpoint:
                candidate.rejected = "breakpoint checkpoint written on failure (*_breakpoint.ckpt), not a regular save"
            else:
                bad = sorted(os.path.basename(p) for p in chosen.values() if os.path.basename(p) in unhealthy)
                if bad:
                    candidate.rejected = f"marked unhealthy in health_ckpts.json: {', '.join(bad)}"
            scan.candidates.append(candidate)
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    @classmethod
    def _unhealthy(cls, root: str) -> set[str]:
        """The files MindFormers' ``health_ckpts.json`` marks unhealthy: beside the save directory's rank folders or
        one level up (one rank's folder scanned alone: one level further)."""
        up = os.path.dirname(os.path.abspath(root))
        folders = (root, up, os.path.dirname(up)) if cls.RANK_DIR.match(os.path.basename(os.path.abspath(root))) \
            else (root, up)
        for directory in folders:
            path = os.path.join(directory, "health_ckpts.json")
            try:
                records = read_json(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                log.warning("resume: %s is unreadable (%s); checkpoint health records ignored", path, exc)
                return set()
            if not isinstance(records, list):
                log.warning("resume: %s is not a list of records; checkpoint health records ignored", path)
                return set()
            return {os.path.basename(str(item.get("ckpt_name", ""))) for item in records
                    if isinstance(item, dict) and item.get("is_health", -1) != 0}
        return set()

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        files = {("rank_%d" % r if r >= 0 else "ckpt"): path for r, path in sorted(candidate.rank_files.items())}
        problems = [f"no {candidate.epoch}_{candidate.step} file for rank_{r}"
                    for r in self._expected if r not in candidate.rank_files]
        return files, problems


def own_folder(root: str, rank: int) -> str:
    """Where one rank's own files are: its ``rank_N`` in a save directory of rank folders, else the directory
    itself (also where it is absent or unreadable here: it then offers nothing)."""
    try:
        entries = listdir(root)
    except OSError:
        return root
    return os.path.join(root, f"rank_{rank}") if MindSporeFiles.rank_dirs(entries) else root


_STEP_RECORD = re.compile(rb"\n\x08step_num\x12")
_RECORD_TAIL = 4096


def recorded_step(path: str) -> int | None:
    """The ``step_num`` a MindSpore checkpoint records (MindFormers appends it after the parameters, so it is
    in the last bytes): the true global step, whatever the file name says. None when absent or unreadable."""
    try:
        with open_regular(path) as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _RECORD_TAIL))
            tail = handle.read()
    except OSError:
        return None
    found = list(_STEP_RECORD.finditer(tail))
    if not found:
        return None
    try:
        record = ProtobufReader(io.BytesIO(tail))
        record.skip(found[-1].end())
        length = record.varint(len(tail))
        tensor = tail[record.position:record.position + length]
        if len(tensor) < length:
            return None
        fields, inner = {}, ProtobufReader(io.BytesIO(tensor))
        while inner.position < len(tensor):
            key = inner.varint(len(tensor))
            if key & 7 != 2:
                return None
            size = inner.varint(len(tensor))
            fields[key >> 3] = tensor[inner.position:inner.position + size]
            inner.skip(size)
    except ValueError:
        return None
    kind, content = fields.get(2, b""), fields.get(3, b"")
    widths = {b"Int64": 8, b"Int32": 4}
    if kind not in widths or len(content) != widths[kind]:
        return None
    return int.from_bytes(content, "little", signed=True)


def rank_file_manifest(path: str) -> str | None:
    """Where the manifest of a per-rank ``<prefix>-<epoch>_<step>.ckpt`` goes; None for other names
    (a ``_breakpoint`` file, a callable prefix's fixed name) that resume never takes as a regular save."""
    match = MindSporeFiles.CKPT.match(os.path.basename(path))
    if match is None or match.group("breakpoint"):
        return None
    return os.path.join(os.path.dirname(path), manifest_name(os.path.basename(path)))


def iteration_dir(save_dir: str, iteration: int) -> str:
    """Where MindFormers saves ``iteration`` in its newer layout: ``<save>/iteration_{K:08d}``."""
    return os.path.join(save_dir, f"iteration_{iteration:08d}")


class MindFormersIterations(Layout):
    """MindFormers' newer layout: ``iteration_{:08d}/`` with ``common.json``, ``metadata.json`` and
    ``[<prefix>-]{model,opt}-<rank:07d>-<total:07d>.safetensors``, plus the tracker file."""

    name = "mindformers"
    ITER = re.compile(r"^iteration_(\d{8})$")
    SHARD = re.compile(r"(?:^|-)(model|opt|optimizer)-(\d{7})-(\d{7})\.safetensors$")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        tracker = tracker_of(root, scan).value
        for entry in dirs(entries):
            match = self.ITER.match(entry.name)
            if match:
                iteration = int(match.group(1))
                scan.candidates.append(Candidate(entry.path, (iteration,), iteration,
                                                 manifests=manifest_inside(entry.path)))
        if isinstance(tracker, int) and not any(c.iteration == tracker for c in scan.candidates):
            scan.notes.append((iteration_dir(root, tracker), f"named by {TRACKER} but missing"))
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        names = {entry.name for entry in listdir(candidate.path)}
        files = {"common.json": os.path.join(candidate.path, "common.json")}
        if "metadata.json" in names:
            files["metadata.json"] = os.path.join(candidate.path, "metadata.json")
        totals: dict[str, int] = {}
        present: dict[str, set[int]] = {}
        for name in names:
            match = self.SHARD.search(name)
            if match:
                kind, index, total = match.group(1), int(match.group(2)), int(match.group(3))
                totals[kind] = total
                present.setdefault(kind, set()).add(index)
                files[f"{kind}-{index:07d}"] = os.path.join(candidate.path, name)
        problems = [] if totals else ["no model *.safetensors files"]
        for kind, total in sorted(totals.items()):
            missing = sorted(set(range(total)) - present[kind])
            if missing:
                problems.append(f"{kind} files missing for ranks {missing[:8]} (of {total})")
        return files, problems

    def details(self, candidate: Candidate) -> Candidate:
        try:
            common = read_json(os.path.join(candidate.path, "common.json"), SMALL_JSON)
        except (OSError, ValueError):
            return candidate
        if isinstance(common, dict):
            candidate.epoch, candidate.step = (value if type(value) is int and value >= 0 else None
                                               for value in (common.get("epoch_num"), common.get("step_num")))
        return candidate

