"""The verdict written at commit: the full check of a checkpoint just committed, run in a process of its own,
so that the first start after this save finds the verdict (:mod:`.verdicts`) and stats the files instead of
reading them all (at 10,000 ranks: seconds of every restart, paid while training goes on instead).

A process, not a thread: the check's CPU (the ``.metadata`` walk alone holds the interpreter lock for a
third of a second at 10,000 ranks) would stall training's Python. It is started by fork and exec with no
Python code in between, so no lock a training thread holds is inherited; it runs at the lowest priority, in
training's process group (a job torn down takes it along). Whatever happens to it, or to the checkpoint
meanwhile (deleted by a rotation), it leaves a whole verdict of the files it found intact, or none: the
verdict is written atomically, and a directory gone is an error it swallows. A checkpoint of fewer than
WORTH entries costs less to check at start than a process does here: none is started for it.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys

from ft_plugins.launch import HELPER_CWD, helper_env  # here, not at the call: an import there could wait on a lock

log = logging.getLogger(__name__)

WORTH = 64  # top-level entries (rank files, rank folders): below this the first check takes milliseconds
_CHILD = ("import os, sys; os.nice(19); from ft_plugins.cli import main; "
          "sys.exit(main(['ckpt', 'verify', *sys.argv[1:]]))")
_started: list[subprocess.Popen] = []  # kept to be reaped: a finished check leaves no zombie


def judge_later(checkpoint: str, deep: bool = False) -> subprocess.Popen | None:
    """Start the full check of a committed checkpoint directory in the background, once it is large enough to
    be worth it; the started process, or None. Never raises: without it the first start checks in full."""
    _started[:] = [process for process in _started if process.poll() is None]
    try:
        with os.scandir(checkpoint) as entries:
            if sum(1 for _ in itertools.islice(entries, WORTH)) < WORTH:
                return None
        process = subprocess.Popen([sys.executable, "-c", _CHILD, os.path.abspath(checkpoint),
                                    *(["--deep"] if deep else [])], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, cwd=HELPER_CWD, env=helper_env(os.environ))
    except OSError as exc:
        log.debug("no check of %s at commit: %s", checkpoint, exc)
        return None
    _started.append(process)
    return process
