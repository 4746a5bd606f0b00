"""The commit manifest: sizes and checksums written once every rank has finished a save.

A checkpoint counts as committed when its manifest exists; it is written to a temporary name
and renamed, so a reader sees either no manifest or a whole one. The fast check compares sizes
and a digest of each file's head and tail (for a torch zip the tail holds every member's CRC);
the deep check compares a full SHA-256 when the writer recorded one.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from ft_plugins.checkpoint.atomic import atomic_file
from ft_plugins.checkpoint.errors import ManifestError
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import (NotRegularFile, is_inside, open_descriptor, open_regular, read_at,
                                          read_json)
from ft_plugins.checkpoint.verdicts import VERDICT_FILE

# the manifests' names, owned here: one per checkpoint directory, one per rank's file, one beside a lone file
MANIFEST = "ft_manifest.json"
RANK_MANIFEST_PREFIX = "ft_manifest-"
VERSION = 1
_HEAD = 4 << 10
_TAIL = 64 << 10
_CHUNK = 8 << 20


def manifest_name(checkpoint_name: str) -> str:
    """The commit manifest of one rank's MindSpore save, written beside its ``.ckpt`` file, named after it
    (two saves with the same epoch/step in their names, e.g. before and after a resume, keep their own)."""
    stem = checkpoint_name[:-len(".ckpt")] if checkpoint_name.endswith(".ckpt") else checkpoint_name
    return f"{RANK_MANIFEST_PREFIX}{stem}.json"


def is_rank_manifest(name: str) -> bool:
    return name.startswith(RANK_MANIFEST_PREFIX) and name.endswith(".json")


def beside(path: str) -> str:
    """The manifest of a single checkpoint file, next to it."""
    return f"{path}.{MANIFEST}"


def sample_digest(path: str, size: int, known_regular: bool = False) -> str:
    """A digest of the head and tail of a file of ``size`` bytes (bounded reads, none past ``size``: on a file of
    that size a read to its end never asks for the end-of-file; ``known_regular``: see
    :func:`.reading.open_descriptor`)."""
    descriptor = open_descriptor(path, known_regular)
    try:
        return _sample(descriptor, size)
    finally:
        os.close(descriptor)


def _sample(descriptor: int, size: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(read_at(descriptor, min(_HEAD, size), 0))
    if size > _HEAD:
        tail = max(_HEAD, size - _TAIL)
        digest.update(read_at(descriptor, size - tail, tail))
    return digest.hexdigest()


def _sized_sample(path: str) -> tuple[int, str]:
    """A file's size and sample digest, as a commit records them: its open and one fstat (what it is and how long)
    where a stat before the open made three metadata operations (a torch_dist save holds a file per rank)."""
    descriptor = open_descriptor(path, known_regular=True)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        return status.st_size, _sample(descriptor, status.st_size)
    finally:
        os.close(descriptor)


def full_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _all_files(base: str) -> list[str]:
    """Every file under ``base`` but ft_plugins' own records, relative to it: a level of folders at a time, the
    folders of a level listed side by side where the file system makes each wait (a dump holds a folder per shard)."""
    found: list[str] = []
    level = [base]
    while level:
        listed = each(_listing, level)
        level = [folder for _, folders in listed for folder in folders]
        found += [os.path.relpath(path, base) for files, _ in listed for path in files]
    return sorted(found)


def _listing(directory: str) -> tuple[list[str], list[str]]:
    """The files (but ft_plugins' own records) and the folders of ``directory``, as paths, as ``os.walk`` sees them:
    a link to a folder is a folder not entered, a folder that cannot be listed holds nothing."""
    files, folders = [], []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir():
                    if not entry.is_symlink():
                        folders.append(entry.path)
                elif not entry.name.startswith((MANIFEST, RANK_MANIFEST_PREFIX, VERDICT_FILE)):
                    files.append(entry.path)
    except OSError:
        pass
    return files, folders


def write_manifest(checkpoint_dir: str, files: Iterable[str] | None = None, *, name: str = MANIFEST,
                   full: bool = False, info: Mapping[str, Any] | None = None, durable: bool = True) -> str:
    """Commit a finished save: record size and digest of ``files`` (paths relative to ``checkpoint_dir``,
    default every file under it) in ``checkpoint_dir/name``, atomically. Returns the manifest's path.

    ``full`` adds a SHA-256 of every file (reads all data; deep verification then compares it). ``durable``:
    see :func:`.atomic.atomic_file`.
    Call it once, on one rank, after all ranks finished writing (e.g. after the save's barrier).
    """
    base = os.fspath(checkpoint_dir)
    relative = sorted(files) if files is not None else _all_files(base)

    def entry(rel: str) -> dict[str, Any]:
        path = os.path.join(base, rel)
        try:
            size, sample = _sized_sample(path)
        except OSError as exc:
            raise ManifestError(f"cannot commit {base}: {rel} is not readable ({exc})") from None
        found: dict[str, Any] = {"size": size, "sample": sample}
        if full:
            found["sha256"] = full_digest(path)
        return found

    # side by side where the file system makes each file wait (a torch_dist save holds a file per rank)
    entries = dict(zip(relative, each(entry, relative)))
    if not entries:
        raise ManifestError(f"cannot commit {base}: it holds no files")
    target = os.path.join(base, name)
    with atomic_file(target, durable=durable) as handle:
        json.dump({"version": VERSION, "files": entries, "info": dict(info or {})}, handle, indent=1)
    return target


def is_dump(manifest: Any) -> bool:
    """Whether a manifest (as :func:`manifest_or_problem` gives it) commits a dying-gasp dump."""
    return isinstance(manifest, dict) and isinstance(manifest.get("info"), dict) and manifest["info"].get("dump") is True


def read_manifest(path: str) -> dict[str, Any] | None:
    """The manifest at ``path``, None when there is none; ManifestError when it is unreadable or malformed
    (every entry must name a file inside the checkpoint and record its size and sample digest)."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"manifest {os.path.basename(path)} is unreadable ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ManifestError(f"manifest {os.path.basename(path)} has no 'files' table")
    for rel, entry in data["files"].items():
        if not is_inside(rel):
            raise ManifestError(f"manifest {os.path.basename(path)} names {rel[:80]!r}, outside the checkpoint")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sample"), str)
                and isinstance(entry.get("sha256", ""), str)):
            raise ManifestError(f"manifest {os.path.basename(path)} has a malformed entry for {rel[:80]!r}")
    return data


def manifest_or_problem(path: str) -> dict[str, Any] | str | None:
    """The manifest at ``path``; the reason when it is unreadable or malformed; None when there is none."""
    try:
        return read_manifest(path)
    except ManifestError as exc:
        return str(exc)


def listed_files(manifest: dict[str, Any] | str | None, base: str) -> list[str]:
    """The files a manifest covers (paths under ``base``); none when it is absent or unreadable."""
    if not isinstance(manifest, dict):
        return []
    inside = base.rstrip(os.sep) + os.sep
    return [inside + rel for rel in manifest["files"]]  # every name checked relative and inside


class Sized(NamedTuple):
    """A manifest compared with its files' stats, nothing read: what is wrong (the manifest itself, or files
    missing or of another size, each of which alone refuses the checkpoint), those files' paths, and else the
    files whose content is still to compare (:func:`content_problems`)."""

    problems: list[str]
    damaged: list[str]
    unread: list[tuple[str, dict[str, Any], os.stat_result]]


def size_problems(manifest: dict[str, Any] | str | None, base: str,
                  stat_of: Callable[[str], os.stat_result] = os.stat) -> Sized | None:
    """A manifest (:func:`manifest_or_problem`; file paths relative to ``base``) compared by sizes; None: no
    manifest. ``stat_of`` gives each file's size (a check's one stat of it)."""
    if manifest is None:
        return None
    if isinstance(manifest, str):
        return Sized([manifest], [], [])
    entries = sorted(manifest["files"].items())
    statuses = each(lambda entry: _status_or_problem(base, entry[0], entry[1], stat_of), entries)
    sized = [(rel, status) for (rel, _), status in zip(entries, statuses) if isinstance(status, str)]
    if sized:
        return Sized([problem for _, problem in sized], [os.path.join(base, rel) for rel, _ in sized], [])
    return Sized([], [], [(rel, expected, status) for (rel, expected), status in zip(entries, statuses)])


def content_problems(sized: Sized, base: str, deep: bool = False) -> list[str]:
    """What does not match the manifest in the content of the files :func:`size_problems` left to read."""
    found = each(lambda unread: _content_problem(base, *unread, deep), sized.unread)
    return [problem for problem in found if problem]


def _status_or_problem(base: str, rel: str, expected: dict[str, Any],
                       stat_of: Callable[[str], os.stat_result]) -> os.stat_result | str:
    """One manifest entry's file as stat-ed, or what is wrong with it short of reading it."""
    try:
        status = stat_of(os.path.join(base, rel))
    except FileNotFoundError:
        return f"{rel}: listed in the manifest but missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(status.st_mode):
        return f"{rel}: not a regular file (a directory, device or FIFO)"
    if status.st_size != expected["size"]:
        return f"{rel}: {status.st_size} bytes, the manifest says {expected['size']}"
    return status


def _content_problem(base: str, rel: str, expected: dict[str, Any], status: os.stat_result,
                     deep: bool) -> str | None:
    """What does not match one manifest entry's content: its sample digest, then (deep) its SHA-256."""
    file_path = os.path.join(base, rel)
    try:
        if sample_digest(file_path, status.st_size, known_regular=True) != expected["sample"]:
            return f"{rel}: content differs from the manifest (a file from another save or run)"
        if deep and "sha256" in expected and full_digest(file_path) != expected["sha256"]:
            return f"{rel}: SHA-256 differs from the manifest"
    except FileNotFoundError:
        return f"{rel}: listed in the manifest but missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc.strerror or exc})"
    return None
