"""Commit one finished save: its manifest, written atomically once the save is complete."""

from __future__ import annotations

import os

from ft_plugins.checkpoint.errors import ManifestError
from ft_plugins.checkpoint.layouts.mindspore import rank_file_manifest
from ft_plugins.checkpoint.manifest import is_rank_manifest, write_manifest


def commit(path: str | os.PathLike[str], full: bool = False) -> str:
    """Commit one finished save, atomically; returns the manifest's path.

    ``path`` is a checkpoint directory (``iter_*``, ``checkpoint-N``: one manifest inside covering every
    file, written by one rank after all ranks finished) or one rank's MindSpore ``<prefix>-<epoch>_<step>.ckpt``
    (a manifest beside it covering that file, written by that rank once its save returned). Raises
    ManifestError for anything else or an unreadable file.
    """
    target = os.fspath(path)
    if os.path.isdir(target):
        return write_manifest(target, full=full)
    manifest = rank_file_manifest(target)
    if manifest is None:
        raise ManifestError(f"cannot commit {target}: neither a checkpoint directory nor a per-rank "
                            "<prefix>-<epoch>_<step>.ckpt file")
    directory = os.path.dirname(target)
    written = write_manifest(directory, [os.path.basename(target)], name=os.path.basename(manifest), full=full)
    _drop_orphan_manifests(directory)
    return written


def _drop_orphan_manifests(directory: str) -> None:
    """Per-rank manifests whose file is gone (ModelCheckpoint's ``keep_checkpoint_max`` removed it) go too."""
    names = os.listdir(directory)
    kept = {os.path.basename(path) for path in map(rank_file_manifest, names) if path is not None}
    for name in names:
        if is_rank_manifest(name) and name not in kept:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
