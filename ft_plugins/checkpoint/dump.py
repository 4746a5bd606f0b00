"""Dying-gasp dumps in Megatron's layout, and the commit that makes one loadable.

A dump of iteration K is written by the survivors, one writer per shard, into
``<save>/iter_{K:07d}_tmp/<shard>/<file>`` (the shard directories Megatron names, e.g. ``mp_rank_00``).
Each writer writes its files in a staging folder of its own under their final names (``torch.save`` names its
archive after the file, so a dump's file is Megatron's save's byte for byte; the folder is removed after the commit,
:func:`clear_staging`), moves them into place, then writes the part record ``<shard>/ft_part.json`` (which shard,
which K, the run's layout, who wrote it, which files): a part without a record is one whose writer was
killed mid-write. The layout, every shard of the run, is written once beside the shards
(``ft_layout-<digest>.json``, before any record that names it) and each record holds its digest: a commit reads
one list, not one per shard (at 10,240 shards the records held 1.8 GB of names).

Commit (:func:`commit_dump`) = coverage check (every shard of the run has a part, every part is of
K) + rename to ``iter_{K:07d}`` + commit manifest + atomic tracker update. It is idempotent and
safe from several writers at once, so it needs no coordinator; the caller elects one where it can count its writers
(the writer of the last part: one committer reads every part's record, instead of each of N writers reading N), and
:func:`complete_pending` finishes an interrupted commit at the next start-up. A dump
is never committed over an existing ``iter_{K:07d}`` (a periodic save of K, maybe half-written), and a periodic
save of K over a committed dump first withdraws its commit (:func:`withdraw`).
Framework-neutral: the caller supplies the function that writes a shard's file.

The dump races the launcher's SIGKILL, and what a killed process wrote stays in the kernel, which writes it back:
so the part and its commit are written without an fsync (as Megatron's own save, which never syncs), and only then
does each writer wait for its file system to have it all on disk (:func:`.atomic.sync_file_system`), the one wait a
node's crash needs. A SIGKILL during that wait loses nothing; a node that crashes before it ends may hold a
committed dump whose data never reached its disk, which ``resume`` judges by its manifest's sizes and samples and
passes over for the newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping

from ft_plugins.checkpoint.atomic import atomic_file, fsync_directory
from ft_plugins.checkpoint.errors import ManifestError
from ft_plugins.checkpoint.manifest import MANIFEST, is_dump, manifest_or_problem, write_manifest
from ft_plugins.checkpoint.naming import ITERATION_DIR, advance_tracker, dump_dir, iteration_dir, tracker_iteration
from ft_plugins.checkpoint.parallel import each

PART_RECORD = "ft_part.json"
LAYOUT_PREFIX = "ft_layout-"  # + the layout's digest + .json: every shard of the run, beside the shards
_DIGEST = re.compile("[0-9a-f]{32}")
STAGING_PREFIX = ".ft_partial-"  # + the writer's rank: its files while written, in the shard directory


@dataclass(frozen=True)
class Part:
    """One shard's file of a dump, as its record describes it."""

    shard: str
    iteration: int
    shards: tuple[str, ...]  # every shard of the run: what the dump must cover
    writer: int  # global rank of the writer
    files: tuple[str, ...] = ()  # what the part holds, each checked before a commit
    attempt: str = ""  # the dump it belongs to, the same for every writer of one dump (none: an older record)
    layout: str = ""  # the digest of ``shards``, what a record holds in their place (read back: shards empty)

    def __post_init__(self) -> None:
        if self.shards and not self.layout:
            object.__setattr__(self, "layout", layout_digest(self.shards))


def layout_digest(shards: Iterable[str]) -> str:
    """The name of a run's layout: the same shards in the same order, the same digest."""
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()[:32]


@dataclass
class Outcome:
    """What :func:`commit_dump` did: ``committed`` (now or earlier) with its directory, else the reasons."""

    iteration: int
    committed: bool
    path: str
    reasons: list[str] = field(default_factory=list)


def write_part(save_dir: str, part: Part, writes: Mapping[str, Callable[[str], None]]) -> int:
    """Write one shard's files of the dump of ``part.iteration`` (``{filename: write(path)}``), then its record.

    Each file appears under its final name only once complete; the record, naming them, after the last; none is
    synced (:func:`.atomic.sync_file_system` follows the commit). Several writers of the same shard are harmless
    (each renames whole files over the other's). Returns the bytes written, counted before the record: once it is
    there, a peer may commit the dump and its directory moves.
    """
    directory = os.path.join(dump_dir(save_dir, part.iteration), part.shard)
    staging = os.path.join(directory, f"{STAGING_PREFIX}{part.writer}")
    shutil.rmtree(staging, ignore_errors=True)  # what an earlier attempt of this writer, killed, left there
    os.makedirs(staging, exist_ok=True)
    written = 0
    for filename, write in writes.items():
        target = os.path.join(directory, filename)
        temporary = os.path.join(staging, filename)  # the final name: torch.save names its archive after the file
        write(temporary)
        written += os.path.getsize(temporary)
        os.replace(temporary, target)
    layout = os.path.join(os.path.dirname(directory), f"{LAYOUT_PREFIX}{part.layout}.json")
    if not os.path.exists(layout):  # the first writers of the dump write it, whole or not at all
        with atomic_file(layout, durable=False) as handle:
            json.dump(list(part.shards), handle)
    record = {**asdict(part), "files": list(writes)}
    del record["shards"]
    with atomic_file(os.path.join(directory, PART_RECORD), durable=False) as handle:
        json.dump(record, handle)
    return written


def clear_staging(save_dir: str, part: Part) -> None:
    """Remove the writer's staging folder, empty once its part is written, wherever the part is now (committed or
    not); never a file. Called after the sync, off the commit's path: removing a directory waits for a busy file
    system's journal (0.07-0.15 s while two ranks wrote 4 GB each)."""
    for directory in (iteration_dir(save_dir, part.iteration), dump_dir(save_dir, part.iteration)):
        try:
            os.rmdir(os.path.join(directory, part.shard, f"{STAGING_PREFIX}{part.writer}"))
        except OSError:
            pass


def read_part(shard_dir: str) -> Part | None:
    """The record of one shard directory; None when there is none (never written, or writer killed). Its shards are
    those of an older record, which listed them; a record now names its layout only (:func:`read_layout`)."""
    try:
        with open(os.path.join(shard_dir, PART_RECORD), "rb") as handle:
            data = json.loads(handle.read())
        shards = tuple(str(name) for name in data.get("shards", ()))
        return Part(str(data["shard"]), int(data["iteration"]), shards, int(data["writer"]),
                    tuple(str(name) for name in data.get("files", ())), str(data.get("attempt", "")),
                    "" if shards else str(data["layout"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_layout(directory: str, layout: str) -> tuple[str, ...] | None:
    """Every shard of the run whose layout is ``layout``, as its first writers wrote it in the dump ``directory``;
    None when it is not there (or not a list of names, or not the one the digest names)."""
    if not _DIGEST.fullmatch(layout):  # a record's word, never a path
        return None
    try:
        with open(os.path.join(directory, f"{LAYOUT_PREFIX}{layout}.json"), "rb") as handle:
            shards = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    if not isinstance(shards, list) or not all(isinstance(name, str) for name in shards):
        return None
    return tuple(shards) if layout_digest(shards) == layout else None


def uncovered(expected: Iterable[str], holders: Mapping[str, Iterable[int]]) -> list[str]:
    """The shards of ``expected`` that no holder covers; ``holders`` maps a shard to the ranks that wrote it.

    The coverage rule on its own: one complete part per shard. With a sharded optimizer state a part
    is written only by a complete instance (its members gathered the state together), so the rule
    stays the same.
    """
    return [shard for shard in sorted(expected) if not list(holders.get(shard, ()))]


def dump_problems(directory: str) -> list[str]:
    """Why the dump in ``directory`` (``iter_K_tmp``, or ``iter_K`` renamed but not yet committed) cannot
    be committed; empty when it can."""
    match = ITERATION_DIR.match(os.path.basename(directory))
    if match is None:
        return [f"{os.path.basename(directory)} is not a dump directory (iter_NNNNNNN_tmp)"]
    iteration = int(match.group(1))
    try:
        shard_dirs = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    except OSError as exc:
        return [f"cannot be listed ({exc.strerror})"]
    problems = []
    holders: dict[str, list[int]] = {}
    attempts: dict[str, list[str]] = {}
    layouts: dict[str, list[str]] = {}  # each layout's digest: the shards whose parts name it
    listed: dict[str, tuple[str, ...]] = {}  # each layout's shards, as older records list them
    # each shard's record and files side by side where the file system makes each wait (a shard per writer)
    for shard, (part, problem) in zip(shard_dirs, each(lambda shard: _judged(directory, iteration, shard),
                                                       shard_dirs)):
        if part is None:
            problems.append(problem)
        else:
            holders.setdefault(shard, []).append(part.writer)
            attempts.setdefault(part.attempt, []).append(shard)
            layouts.setdefault(part.layout, []).append(shard)
            if part.shards:
                listed[part.layout] = part.shards
    expected: set[str] = set()
    for layout, named_by in layouts.items():
        shards = listed.get(layout) or read_layout(directory, layout)
        if shards is None:
            problems.append(f"{', '.join(named_by)}: the run's shards ({LAYOUT_PREFIX}{layout}.json) missing")
        else:
            expected.update(shards)
            listed[layout] = shards
    if len(attempts) > 1:
        problems.append("parts of different dumps of the step (" + "; ".join(
            f"{', '.join(shards)} of {attempt or 'an unnamed one'}" for attempt, shards in sorted(attempts.items()))
            + "): an earlier attempt's parts are never committed with a later one's")
    if len(layouts) > 1:
        problems.append("parts of different layouts (" + "; ".join(
            f"{', '.join(named_by)} of a run of {_shards(listed.get(layout))}"
            for layout, named_by in sorted(layouts.items(), key=lambda item: item[1])) + ")")
    if not holders and not problems:
        problems.append("no parts written")
    missing = uncovered(expected, holders)
    if missing:
        problems.append(f"shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing "
                        "(no survivor holding it wrote it)")
    if match.group(2) and os.path.exists(iteration_dir(os.path.dirname(directory), iteration)):
        problems.append(f"iter_{iteration:07d} already exists (a periodic save of the same step, maybe "
                        "half-written): the dump is not committed over it")
    return problems


def _shards(shards: tuple[str, ...] | None) -> str:
    if shards is None:
        return "unknown shards"
    return f"{len(shards)} shard{'s' if len(shards) > 1 else ''} ({shards[0]}{', ...' if len(shards) > 1 else ''})"


def _judged(directory: str, iteration: int, shard: str) -> tuple[Part | None, str]:
    """One shard directory's part, or None and why it does not count."""
    part = read_part(os.path.join(directory, shard))
    if part is None:
        return None, f"{shard}: no part record (its writer was killed mid-write)"
    if part.iteration != iteration or part.shard != shard:
        return None, (f"{shard}: part of iteration {part.iteration} ({part.shard}), not of {iteration} "
                      "(parts from different steps)")
    absent = [name for name in part.files if not _is_file(os.path.join(directory, shard, name))]
    if absent:
        return None, f"{shard}: {', '.join(absent)} missing beside its part record"
    return part, ""


def _is_file(path: str) -> bool:
    """A regular file, not a link to one: one ``lstat`` (a metadata operation fewer than isfile and islink)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def pending_reason(directory: str) -> str:
    """What ``resume`` and ``ft-plugins ckpt`` say about a dump directory they pass over."""
    problems = dump_problems(directory)
    if problems:
        return "dying-gasp dump never committed: " + "; ".join(problems)
    return "dying-gasp dump complete but not committed yet (ttp commits it at the next start-up)"


def commit_dump(save_dir: str, iteration: int, durable: bool = True) -> Outcome:
    """Commit the dump of ``iteration`` if it is complete; idempotent and safe to run from several ranks.
    ``durable=False``: no fsync (the dying gasp's commit, :func:`.atomic.sync_file_system` after it)."""
    final, temporary = iteration_dir(save_dir, iteration), dump_dir(save_dir, iteration)
    checked = False  # this call checked the dump it renamed: nothing writes into it since
    if os.path.isdir(temporary):
        problems = dump_problems(temporary)
        if problems:
            return Outcome(iteration, False, temporary, problems)
        checked = True
        try:
            os.rename(temporary, final)
        except OSError:
            if os.path.isdir(temporary) or not os.path.isdir(final):
                raise
        if durable:
            fsync_directory(save_dir)
    if not os.path.isdir(final):
        return Outcome(iteration, False, temporary, ["no dump of this iteration"])
    if not os.path.exists(os.path.join(final, MANIFEST)):
        problems = [] if checked else dump_problems(final)  # renamed by a committer that died before the manifest
        if problems:
            return Outcome(iteration, False, final, problems)
        try:
            write_manifest(final, info={"dump": True, "iteration": iteration}, durable=durable)
        except ManifestError as exc:
            return Outcome(iteration, False, final, [str(exc)])
    advance_tracker(save_dir, iteration, durable=durable)
    return Outcome(iteration, True, final)


def withdraw(save_dir: str, iteration: int) -> bool:
    """Before a save writes into ``iter_K``: a dump committed there stops counting as committed (its manifest goes),
    so that a save cut short over it, part its files and part the dump's, is never taken for a committed dump. A
    save's own commit writes the manifest again once it completed. Whether a dump's manifest was removed."""
    manifest = os.path.join(iteration_dir(save_dir, iteration), MANIFEST)
    if not is_dump(manifest_or_problem(manifest)):
        return False
    try:
        os.unlink(manifest)
    except FileNotFoundError:  # another rank of the save withdrew it first
        return False
    return True


def _is_uncommitted_dump(entry: os.DirEntry) -> bool:
    match = ITERATION_DIR.match(entry.name)
    if match is None or not entry.is_dir():
        return False
    if match.group(2):
        return True
    if os.path.exists(os.path.join(entry.path, MANIFEST)):
        return False
    return any(read_part(sub.path) is not None for sub in os.scandir(entry.path) if sub.is_dir())


def complete_pending(save_dir: str) -> list[Outcome]:
    """At start-up: commit every complete dump newer than the tracker, newest first; report the others."""
    try:
        entries = [entry for entry in os.scandir(save_dir) if _is_uncommitted_dump(entry)]
    except FileNotFoundError:
        return []
    tracker = tracker_iteration(save_dir) or 0
    iterations = sorted({int(ITERATION_DIR.match(entry.name).group(1)) for entry in entries}, reverse=True)
    return [commit_dump(save_dir, iteration) for iteration in iterations if iteration > tracker]
