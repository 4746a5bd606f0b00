"""Where each framework puts its checkpoints, and what one complete checkpoint consists of.

A layout turns a save directory into candidates, newest first, from directory and file names
alone; :meth:`Layout.contents` then lists one candidate's files by *role* (a name that is the
same for every checkpoint of a run, e.g. ``mp_rank_01/model_optim_rng.pt``) so that a candidate
can be compared with its neighbour and each file probed. Nothing here opens a file except the
small text/JSON files a layout uses as pointers.
"""

from __future__ import annotations

import io
import logging
import os
import re
from dataclasses import dataclass, field

from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.checkpoint.probes import ProtobufReader, is_inside, open_regular, read_json

log = logging.getLogger("ft_plugins.resume")

TRACKER = "latest_checkpointed_iteration.txt"
_RELEASE_FIRST = 1 << 62  # a release named by the tracker sorts before every iteration
_SMALL_JSON = 1 << 20  # pointer and config files are a few hundred bytes; never read more


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
    manifests: list[tuple[str, str]] = field(default_factory=list)  # (manifest, directory its paths are relative to)
    rank_files: dict[int, str] = field(default_factory=dict)


@dataclass
class Scan:
    """A layout's reading of one save directory: candidates newest first, plus pointer problems
    (a tracker naming a missing iteration, a garbage tracker) reported as skipped entries."""

    candidates: list[Candidate]
    notes: list[tuple[str, str]] = field(default_factory=list)


def _listdir(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as entries:
        return list(entries)


def _is(entry: os.DirEntry, kind: str) -> bool:
    """``entry.is_dir()`` / ``is_file()``, False for what cannot be resolved (a symlink loop, a dangling link)."""
    try:
        return getattr(entry, kind)()
    except OSError:
        return False


def _mtime(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return -1


def _dirs(entries: list[os.DirEntry]) -> list[os.DirEntry]:
    return [entry for entry in entries if _is(entry, "is_dir")]


def _read_tracker(root: str, scan: Scan) -> str | None:
    """The tracker's content: ``"release"``, digits, or None (absent or garbage, noted)."""
    path = os.path.join(root, TRACKER)
    try:
        with open_regular(path) as handle:
            raw = handle.read(64)
    except FileNotFoundError:
        return None
    except OSError as exc:
        scan.notes.append((path, f"tracker cannot be read ({exc.strerror or exc}); ignored, checkpoints chosen "
                                 "by their directories"))
        return None
    text = raw.decode("ascii", "replace").strip()
    if text == "release" or text.isdigit():
        return text
    scan.notes.append((path, f"tracker content {text[:20]!r} is neither an iteration number nor 'release'; "
                             "ignored, checkpoints chosen by their directories"))
    return None


def _manifest_inside(directory: str) -> list[tuple[str, str]]:
    """The single manifest of a directory-style checkpoint (written after every rank finished)."""
    return [(os.path.join(directory, MANIFEST), directory)]


class Layout:
    name = ""

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        raise NotImplementedError

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        """``({role: path}, problems)`` for the files this candidate must hold."""
        raise NotImplementedError

    def details(self, candidate: Candidate) -> Candidate:
        """Fill in what only the chosen candidate needs (epoch/step read from a small JSON)."""
        return candidate


class Megatron(Layout):
    """``iter_{:07d}/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`` (+ ``distrib_optim.pt``), or a
    ``torch_dist`` directory (``.metadata``, ``metadata.json``, ``*.distcp``, and ``common.pt`` when
    ``metadata.json`` names a ``common_backend``: megatron-core before 0.19 writes it, 0.19 and later keep
    the common state inside the ``.distcp`` files); ``iter_{:07d}_tmp`` is a dying-gasp save still in
    progress; the tracker names the last commit."""

    name = "megatron"
    ITER = re.compile(r"^iter_(\d+)(_tmp)?$")
    RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")
    DIST_REQUIRED = (".metadata", "metadata.json")
    DIST_COMMON = "common.pt"

    @classmethod
    def matches(cls, names: set[str]) -> bool:
        return any(cls.ITER.match(name) for name in names) or "release" in names

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        tracker = _read_tracker(root, scan)
        iterations = set()
        for entry in _dirs(entries):
            match = self.ITER.match(entry.name)
            if match:
                iteration, temporary = int(match.group(1)), bool(match.group(2))
                candidate = Candidate(entry.path, (iteration, 0 if temporary else 1), iteration,
                                      manifests=_manifest_inside(entry.path))
                if temporary:
                    from ft_plugins.checkpoint.dump import pending_reason  # dump builds on this module

                    candidate.rejected = pending_reason(entry.path)
                else:
                    iterations.add(iteration)
                scan.candidates.append(candidate)
            elif entry.name == "release":
                top = tracker == "release"
                scan.candidates.append(Candidate(entry.path, (_RELEASE_FIRST if top else -1, 1), None,
                                                 manifests=_manifest_inside(entry.path)))
        if tracker and tracker.isdigit() and int(tracker) not in iterations:
            missing = os.path.join(root, f"iter_{int(tracker):07d}")
            scan.notes.append((missing, f"named by {TRACKER} but missing"))
        if tracker == "release" and not any(c.key[0] == _RELEASE_FIRST for c in scan.candidates):
            scan.notes.append((os.path.join(root, "release"), f"named by {TRACKER} but missing"))
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        entries = _listdir(candidate.path)
        names = {entry.name for entry in entries}
        if names & {*self.DIST_REQUIRED, self.DIST_COMMON} or any(name.endswith(".distcp") for name in names):
            required = [*self.DIST_REQUIRED, *sorted(n for n in names if n.endswith(".distcp"))]
            if self.DIST_COMMON in names or self._names_common_backend(os.path.join(candidate.path, "metadata.json")):
                required.append(self.DIST_COMMON)
            files = {name: os.path.join(candidate.path, name) for name in required}
            problems = [] if any(name.endswith(".distcp") for name in names) else ["no *.distcp data files"]
            return files, problems
        files = {}
        rank_dirs = [entry for entry in _dirs(entries) if self.RANK_DIR.match(entry.name)]
        for rank_dir in rank_dirs:
            inner = {entry.name for entry in _listdir(rank_dir.path)}
            for name in ("model_optim_rng.pt", *sorted(inner & {"distrib_optim.pt"})):
                files[f"{rank_dir.name}/{name}"] = os.path.join(rank_dir.path, name)
        return files, [] if rank_dirs else ["no mp_rank_* directories and no torch_dist files"]


    @staticmethod
    def _names_common_backend(config: str) -> bool:
        """Whether ``metadata.json`` (written last, once every shard is saved) records a separate common
        backend, i.e. a ``common.pt``; an unreadable one is reported by its own probe."""
        try:
            recorded = read_json(config, _SMALL_JSON)
        except (OSError, ValueError):
            return False
        return isinstance(recorded, dict) and "common_backend" in recorded


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
        for entry in _dirs(entries):
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
                files = _listdir(directory)
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
                order = (candidate.iteration is None, candidate.iteration or 0, _mtime(own))
            else:
                order = (epoch, step, _mtime(own))
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

    @staticmethod
    def _unhealthy(root: str) -> set[str]:
        for directory in (root, os.path.dirname(os.path.abspath(root))):
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


def manifest_name(checkpoint_name: str) -> str:
    """The commit manifest of one rank's MindSpore save, written beside its ``.ckpt`` file, named after it
    (two saves with the same epoch/step in their names, e.g. before and after a resume, keep their own)."""
    stem = checkpoint_name[:-len(".ckpt")] if checkpoint_name.endswith(".ckpt") else checkpoint_name
    return f"ft_manifest-{stem}.json"


def rank_file_manifest(path: str) -> str | None:
    """Where the manifest of a per-rank ``<prefix>-<epoch>_<step>.ckpt`` goes; None for other names
    (a ``_breakpoint`` file, a callable prefix's fixed name) that resume never takes as a regular save."""
    match = MindSporeFiles.CKPT.match(os.path.basename(path))
    if match is None or match.group("breakpoint"):
        return None
    return os.path.join(os.path.dirname(path), manifest_name(os.path.basename(path)))


class MindFormersIterations(Layout):
    """MindFormers' newer layout: ``iteration_{:08d}/`` with ``common.json``, ``metadata.json`` and
    ``[<prefix>-]{model,opt}-<rank:07d>-<total:07d>.safetensors``, plus the tracker file."""

    name = "mindformers"
    ITER = re.compile(r"^iteration_(\d{8})$")
    SHARD = re.compile(r"(?:^|-)(model|opt|optimizer)-(\d{7})-(\d{7})\.safetensors$")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        tracker = _read_tracker(root, scan)
        for entry in _dirs(entries):
            match = self.ITER.match(entry.name)
            if match:
                iteration = int(match.group(1))
                scan.candidates.append(Candidate(entry.path, (iteration,), iteration,
                                                 manifests=_manifest_inside(entry.path)))
        if tracker and tracker.isdigit() and not any(c.iteration == int(tracker) for c in scan.candidates):
            scan.notes.append((os.path.join(root, f"iteration_{int(tracker):08d}"), f"named by {TRACKER} but missing"))
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        names = {entry.name for entry in _listdir(candidate.path)}
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
            common = read_json(os.path.join(candidate.path, "common.json"), _SMALL_JSON)
        except (OSError, ValueError):
            return candidate
        if isinstance(common, dict):
            candidate.epoch, candidate.step = (value if type(value) is int and value >= 0 else None
                                               for value in (common.get("epoch_num"), common.get("step_num")))
        return candidate


class HuggingFace(Layout):
    """Hugging Face Trainer: ``checkpoint-N/`` with ``trainer_state.json``, the weights (safetensors,
    ``pytorch_model.bin`` or sharded with an index), and optimizer/scheduler/RNG state; Accelerate's
    ``save_state``: ``checkpoint_N/`` (weights, optimizer, scheduler, ``random_states_*``). transformers
    v5 leaves ``checkpoint-is-incomplete.txt`` in a just-in-time save until it is complete."""

    name = "hf"
    CHECKPOINT = re.compile(r"^(tmp-)?checkpoint([-_])(\d+)$")
    INCOMPLETE = "checkpoint-is-incomplete.txt"
    WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        for entry in _dirs(entries):
            match = self.CHECKPOINT.match(entry.name)
            if match:
                step, temporary = int(match.group(3)), bool(match.group(1))
                candidate = Candidate(entry.path, (step, 0 if temporary else 1), step,
                                      manifests=_manifest_inside(entry.path))
                if temporary:
                    candidate.rejected = "save still in progress (tmp-checkpoint-N never renamed)"
                scan.candidates.append(candidate)
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        names = {entry.name for entry in _listdir(candidate.path) if _is(entry, "is_file")} - {MANIFEST}
        files = {name: os.path.join(candidate.path, name) for name in names - {self.INCOMPLETE}}
        if os.path.basename(candidate.path).startswith(("checkpoint-", "tmp-checkpoint-")):
            files["trainer_state.json"] = os.path.join(candidate.path, "trainer_state.json")
        problems = [] if names & set(self.WEIGHTS) else ["no model weights (model.safetensors, pytorch_model.bin, ...)"]
        if self.INCOMPLETE in names:
            problems.append(f"{self.INCOMPLETE} present: the save did not complete")
        for index in names & {"model.safetensors.index.json", "pytorch_model.bin.index.json"}:
            try:
                table = read_json(files[index])
            except (OSError, ValueError):
                continue  # the probe of the index file reports it
            weight_map = table.get("weight_map") if isinstance(table, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(shard, str) for shard in weight_map.values())):
                problems.append(f"{index}: no weight_map table of tensor names to shard files")
                continue
            shards = set(weight_map.values())
            outside = sorted(repr(shard)[:80] for shard in shards if not is_inside(shard))
            if outside:
                problems.append(f"{index} names shard files outside the checkpoint: {', '.join(outside[:3])}")
            for shard in sorted(shard for shard in shards if is_inside(shard)):
                files[shard] = os.path.join(candidate.path, shard)
        return files, problems


class TorchFiles(Layout):
    """Single ``torch.save`` files in one directory (``checkpoint.pth.tar``, ``epoch_3.pt``, as ResNet-style
    scripts write them): newest by modification time, each probed as a torch zip archive."""

    name = "torch"
    SUFFIXES = (".pt", ".pth", ".pth.tar")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        files = [entry for entry in entries if entry.name.endswith(self.SUFFIXES) and _is(entry, "is_file")]
        candidates = [Candidate(entry.path, (_mtime(entry),),
                                manifests=[(f"{entry.path}.{MANIFEST}", root)]) for entry in files]
        return Scan(sorted(candidates, key=lambda c: c.key, reverse=True))

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        return {"file": candidate.path}, []


FORMATS = ("auto", "megatron", "mindspore", "mindformers", "hf", "torch")


def detect(entries: list[os.DirEntry], format: str) -> Layout | None:
    """The layout of a save directory from its entries' names, or for an explicit ``format``."""
    names = {entry.name for entry in entries}
    has_iterations = any(MindFormersIterations.ITER.match(name) for name in names)
    ranks = MindSporeFiles.rank_dirs(entries)
    has_meta = any(os.path.exists(os.path.join(path, "meta.json")) for path in ranks.values())
    if format == "megatron" or (format == "auto" and Megatron.matches(names)):
        return Megatron()
    if format == "mindformers" or (format == "auto" and (has_iterations or has_meta)):
        return MindFormersIterations() if has_iterations else MindSporeFiles("mindformers")
    if format == "hf" or (format == "auto" and any(HuggingFace.CHECKPOINT.match(name) for name in names)):
        return HuggingFace()
    if format == "mindspore" or (format == "auto" and (ranks or any(n.endswith(".ckpt") for n in names))):
        return MindSporeFiles()
    if format == "torch" or (format == "auto" and any(n.endswith(TorchFiles.SUFFIXES) for n in names)):
        return TorchFiles()
    return None
