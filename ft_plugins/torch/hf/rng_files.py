"""Every rank's ``rng_state_{i}.pth`` in a Trainer dying-gasp checkpoint: each survivor hands its own file,
at the dumped step, to the writer through torchrun's store; a lost rank's file is a copy of the writer's.

Accelerate keeps only the sampler's generator in step across ranks; torch's, numpy's and Python's drift apart
(dropout over dynamically padded batches, augmentations), so each rank's file must be its own. It travels
through the store, not a shared directory: it is a few KB, the store outlives every worker and elects the
writer already, and the checkpoint's directory need not be shared between nodes. A survivor that is not the
writer hands its file over at once; the writer gathers the files after its own writes, waiting for the
missing ones at most until :data:`PEER_WAIT` seconds after its dump began (a survivor blocked in a
collective reaches its dump when torchrun's SIGTERM does, about 0.1 s after a peer's loss), and writes them
into its staging directory before the commit. A file that comes later is left out: a committed checkpoint
is never changed.

A lost rank's state died with it. Its file is a copy of the writer's: exact where the ranks' generators had
not drifted apart (with fixed-length batches every rank draws alike: measured identical), otherwise the
relation every rank had at the start of the run (``set_seed`` gives all of them the same generators).
Without a file the Trainer (one info line) would leave that rank with what its new process seeded at
start-up, replaying the draws of the run's first steps: exact nowhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

from ft_plugins.torch.hf.rng import restore

log = logging.getLogger("ft_plugins.ttp")

PEER_WAIT = 2.0  # seconds from the start of a dump the writer waits for the survivors' RNG files
_POLL = 0.01


def own_file(trainer: Any, rng: dict[str, Any]) -> bytes:
    """This rank's RNG file at the dumped step, written by the Trainer's own ``_save_rng_state``."""
    restore(rng)  # this process exits after the dump: its own RNG no longer matters
    with tempfile.TemporaryDirectory(prefix="ft_plugins-rng-") as directory:
        trainer._save_rng_state(directory)
        (name,) = os.listdir(directory)
        with open(os.path.join(directory, name), "rb") as handle:
            return handle.read()


def offer(key: str, rank: int, data: bytes) -> None:
    """Hand this rank's file to the survivor that writes the dump of ``key``; never raises."""
    try:
        _store().set(_file_key(key, rank), data)
    except Exception as exc:
        log.debug("ttp: rank %d cannot hand its RNG file over (%s: %s)", rank, type(exc).__name__, exc)


def gather(key: str, world: int, writer: int, deadline: float) -> dict[int, bytes]:
    """The other ranks' files handed over for ``key`` by ``deadline`` (``time.monotonic``)."""
    files: dict[int, bytes] = {}
    missing = [index for index in range(world) if index != writer]
    if not missing:
        return files
    try:
        store = _store()
        while True:
            for index in [index for index in missing if store.check([_file_key(key, index)])]:
                files[index] = store.get(_file_key(key, index))
                missing.remove(index)
            if not missing or time.monotonic() >= deadline:
                return files
            time.sleep(_POLL)
    except Exception as exc:
        log.debug("ttp: the survivors' RNG files are out of reach (%s: %s)", type(exc).__name__, exc)
    return files


def write_files(directory: str, files: dict[int, bytes], world: int, writer: int) -> list[int]:
    """The other ranks' files beside the writer's own, a lost rank's as a copy of it; returns the lost ranks."""
    lost = [index for index in range(world) if index != writer and index not in files]
    for index, data in files.items():
        with open(os.path.join(directory, _file_name(index)), "wb") as handle:
            handle.write(data)
    for index in lost:
        shutil.copyfile(os.path.join(directory, _file_name(writer)), os.path.join(directory, _file_name(index)))
    return lost


def _file_name(index: int) -> str:
    return f"rng_state_{index}.pth"


def _file_key(key: str, rank: int) -> str:
    return f"{key}/{_file_name(rank)}"


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
