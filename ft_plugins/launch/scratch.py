"""A launcher's scratch directory in the temporary directory, removed when the launcher exits, and what a launcher
ended by SIGKILL left, removed by the next one.

A launcher killed whole (SIGKILL: a node lost, a pod evicted, the OOM killer) runs no exit handler, and its
directory would stay for good: dozens a day on a node where jobs are killed so. Each directory holds an owner file
its launcher keeps locked (``flock``) for as long as it runs; the kernel drops the lock when the process ends,
however it ends. A launcher making a directory first removes those of its kind whose lock it can take and whose
owner file holds a pid: their owners are gone. The pid is written after the lock is taken, so a directory whose
owner has not locked it yet (an empty owner file) is never taken for a dead one's.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import logging
import os
import shutil
import tempfile

log = logging.getLogger("ft_plugins.launch")

OWNER = ".owner"  # the file its launcher keeps locked, holding its pid


def owned_directory(prefix: str) -> str:
    """A new directory named ``prefix...`` in the temporary directory, owned by this process for its lifetime and
    removed when it exits; the directories of ``prefix`` whose owners are gone, removed first."""
    for gone in _orphans(prefix):
        shutil.rmtree(gone, ignore_errors=True)
        log.info("removed %s: the launcher that made it was ended without its exit (SIGKILL)", gone)
    directory = tempfile.mkdtemp(prefix=prefix)
    owner = os.open(os.path.join(directory, OWNER), os.O_CREAT | os.O_WRONLY, 0o600)  # not inherited by children
    fcntl.flock(owner, fcntl.LOCK_EX)  # held until this process ends: the descriptor is never closed
    os.write(owner, str(os.getpid()).encode())
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _orphans(prefix: str) -> list[str]:
    """The directories of ``prefix`` whose owner is gone: its lock free, its pid written."""
    found = []
    for directory in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), glob.escape(prefix) + "*")):
        try:
            owner = os.open(os.path.join(directory, OWNER), os.O_RDONLY)
        except OSError:  # not one of ours (or of a release before owner files), or not ours to read
            continue
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.read(owner, 32).strip():
                found.append(directory)
        except OSError:  # held: its launcher runs
            pass
        finally:
            os.close(owner)
    return found
