"""The built-in engine's dump against msrun's clock: how fast this job writes, and whether a dump fits.

msrun polls its workers once a second and, when one has exited with an error, SIGKILLs every other worker's
process group at once: no SIGTERM, no handler runs (``join_processes`` in MindSpore's
``parallel/cluster/process_entity/_api.py``). The dump (:mod:`.dump`) is written by a watcher thread the moment
it sees a peer gone, from the host copy of the last completed step, so it has what is left of that second.
Under ``ft-plugins run -- msrun`` that kill is SIGTERM first, then the run's grace (:mod:`ft_plugins.launch.shutdown`).
Every regular save's and every dump's write is recorded in the save root (:mod:`ft_plugins.grace`). After its first
step and each save (rank 0's, seen by the ranks of other nodes in the record within ``LOOK_EVERY`` seconds), what a
dump of every rank's file at that speed needs is reported to ``ft-plugins run``, whose grace follows it; without
one, rank 0 says once when the dump needs longer than it gets.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

from ft_plugins import grace
from ft_plugins.mindspore.base import STEP_END, on_instance
from ft_plugins.rank import is_rank_zero

log = logging.getLogger("ft_plugins.ttp")

MSRUN_GRACE = 1.0  # msrun's poll: a dump longer than this may be SIGKILLed before it is written
LOOK_EVERY = 10.0  # seconds between looks for a write another process recorded (a stat of the record)
LAUNCHER = "msrun"


def under_msrun() -> bool:
    """Whether this worker's parent is msrun (the launcher that SIGKILLs the others when one dies)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return any(os.path.basename(arg) == LAUNCHER.encode() for arg in handle.read().split(b"\0")[:2])
    except OSError:
        return False


def launcher_grace(env: Mapping[str, str]) -> tuple[float, str, str]:
    """The seconds a survivor gets to write after a worker's death, whose they are, and how to get more."""
    if grace.GRACE_VAR in env:
        given, _ = grace.worker_grace(env)
        return given, f"ft-plugins run's grace of {given:g} s before SIGKILL", "raise it with --grace"
    return (MSRUN_GRACE, f"msrun's grace (it SIGKILLs every worker within {MSRUN_GRACE:g} s of one's death)",
            "launch with 'ft-plugins run -- msrun' for a grace")


class WriteSpeed:
    """Records this job's writes in ``root`` and says once when a dump of ``dump_bytes`` would outlast msrun."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.said = False
        self.pending = True  # a write was recorded (or none looked at yet) since the last look
        self.file_bytes = 0  # this rank's last save file: a dump's file holds the same in the same format
        self.looked, self.stamp = time.monotonic(), 0  # the last look at the record, its modification time then

    def record(self, written: int, seconds: float, what: str) -> None:
        grace.record(self.root, grace.Measured(written, seconds, what))
        self.pending = True

    def warn(self, files: int, state_bytes: int) -> None:
        """After a recorded write: the dump of ``files`` files (every rank's, as a survivor may write them), each
        holding ``state_bytes`` of parameters, at the recorded speed, reported to ``ft-plugins run`` where the
        grace follows it (``FT_PLUGINS_GRACE_FOLLOWS``), else said once by rank 0 when it needs longer than msrun
        gives. A file is counted as large as this rank's last save file when that is larger (the format's own
        bytes, in a small state)."""
        follows = os.environ.get(grace.GRACE_FOLLOWS_VAR)
        if not self.pending and not (follows and self._recorded_elsewhere()):
            return
        dump_bytes = files * max(state_bytes, self.file_bytes)
        self.pending = False
        found = grace.measured(self.root) if (follows or is_rank_zero()) and under_msrun() else None
        if found is None:
            return
        if follows:
            grace.report(follows, grace.Measured(dump_bytes, dump_bytes / found.speed,
                                                 f"{found.what}, for a dump of {files} file{'s' * (files > 1)}"))
            return
        seconds = grace.estimate(dump_bytes, found.speed, fixed=0.0)
        given, whose, fix = launcher_grace(os.environ)
        if not self.said and seconds > given:
            self.said = True
            log.warning("ttp: a dump needs about %.1f s (%s, every rank's file, at %s, measured on the %s), longer "
                        "than %s: it would be cut short and the steps since the last save lost; %s", seconds,
                        grace.amount(dump_bytes), grace.amount(found.speed, "B/s"), found.what, whose, fix)

    def _recorded_elsewhere(self) -> bool:
        """Whether another process recorded a write since the last look (rank 0's saves, for the ranks of a node
        without it, whose launcher's grace follows their reports); looked at every :data:`LOOK_EVERY` s at most."""
        now = time.monotonic()
        if now - self.looked < LOOK_EVERY:
            return False
        self.looked = now
        try:
            stamp = os.stat(os.path.join(self.root, grace.RECORD)).st_mtime_ns
        except OSError:
            return False
        changed, self.stamp = stamp != self.stamp, stamp
        return changed

    def timed_saves(self, checkpoint: Any) -> Callable[[], None]:
        """Rank 0 records each save its ``ModelCheckpoint`` makes in a step end (an asynchronous save's time is
        not its write's); returns the undo."""
        config = getattr(checkpoint, "_config", None)
        if checkpoint is None or not is_rank_zero() or getattr(config, "async_save", False):
            return lambda: None
        step_end = getattr(checkpoint, STEP_END)

        def timed(run_context: Any) -> None:
            before, started = checkpoint.latest_ckpt_file_name, time.monotonic()
            step_end(run_context)
            latest = checkpoint.latest_ckpt_file_name
            if latest and latest != before and os.path.isfile(latest):
                self.file_bytes = os.path.getsize(latest)
                self.record(self.file_bytes, time.monotonic() - started, f"save {os.path.basename(latest)}")

        return on_instance(checkpoint, STEP_END, timed)
