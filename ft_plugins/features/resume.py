"""``resume``: load the newest intact checkpoint, and commit each save with a manifest.

Framework-neutral policy over :mod:`ft_plugins.checkpoint`; the framework glue
(:mod:`ft_plugins.torch.megatron.resume`, the MindSpore callback) asks :meth:`Resume.choose` which
checkpoint to load and calls :meth:`Resume.commit` once a save finished: on every rank for a
checkpoint directory, on its own rank for a MindSpore per-rank file.

:mod:`ft_plugins.checkpoint`'s selection and commit are imported on first use, not with the feature (only
its errors are): every training process imports the feature at start-up, few of them look at checkpoints
before the first save.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from ft_plugins import events
from ft_plugins.config import Option, parse_bool
from ft_plugins.features.base import Feature
from ft_plugins.rank import is_rank_zero

if TYPE_CHECKING:
    from ft_plugins.checkpoint.agreed import Gather
    from ft_plugins.checkpoint.select import Selection

log = logging.getLogger("ft_plugins.resume")


class Resume(Feature):
    name = "resume"
    summary = "resume from the newest intact checkpoint; commit manifests after saves"
    options = (
        Option("deep", False, "verify full checksums and CRCs instead of structure and sizes", parse_bool),
        Option("allow_scratch", False, "start from scratch when checkpoints exist but none is intact",
               parse_bool),
        Option("manifest", True, "write a commit manifest (sizes, checksums) after every save", parse_bool),
        Option("full_checksum", False, "put a full SHA-256 of every file in the manifest (reads all data)",
               parse_bool),
    )

    def start(self) -> str:
        self.loaded: Selection | None = None
        self.followed_iteration: int | None = None  # ranks that load what another rank chose
        self.committed = 0
        return "no vendor runtime needed"

    def choose(self, directory: str, format: str = "auto", rank: int | None = None,
               gather: Gather | None = None) -> Selection:
        """The checkpoint to resume from, logging every skipped one; raises NoIntactCheckpoint when
        checkpoints exist, none is intact and ``allow_scratch`` is off. Saves that never finished (a dying-gasp
        dump cut short) are not checkpoints: alone, they leave the job to start as it would without one.

        ``gather`` (an all-gather over every rank): this rank examines only its own files (its ``rank_N`` of
        ``directory``, where it has rank folders), and the ranks agree on the newest checkpoint intact on all of them
        (:mod:`ft_plugins.checkpoint.agreed`); every rank must call it then, whatever its directory holds."""
        from ft_plugins.checkpoint.errors import NoIntactCheckpoint
        from ft_plugins.checkpoint.select import find_latest

        started = time.monotonic()
        if gather is None:
            selection = find_latest(directory, format, rank=rank, deep=self.settings["deep"])
        else:
            selection = self._agreed(directory, format, rank or 0, gather)
        checked = check_time(started)
        self.loaded = selection
        events.emit("resume", chosen=selection.path, skipped=[[s.path, s.reason] for s in selection.skipped])
        # every rank sees the same, rank 0 says it; with gather each rank says the damage of its own files
        level = logging.WARNING if is_rank_zero() or gather is not None else logging.DEBUG
        for skipped in selection.skipped:
            log.log(level, "resume: skipped %s: %s", skipped.path, skipped.reason)
        if selection.path is not None:
            if selection.skipped:
                log.warning("resume: using %s instead (%s)", selection.path, checked)
            else:
                log.info("resume: newest checkpoint %s is intact (%s)", selection.path, checked)
        elif all(skipped.unfinished for skipped in selection.skipped):
            if selection.skipped:  # a dump cut short, say by the launcher's SIGKILL: no checkpoint was ever made
                log.warning("resume: %s holds no checkpoint, only saves that never finished (%s); starting as the "
                            "job would without one", directory,
                            ", ".join(os.path.basename(skipped.path) for skipped in selection.skipped))
        elif not self.settings["allow_scratch"]:
            names = ", ".join(os.path.basename(skipped.path) for skipped in selection.skipped[:5])
            more = f" and {len(selection.skipped) - 5} more" if len(selection.skipped) > 5 else ""
            raise NoIntactCheckpoint(
                f"{directory} holds checkpoints but none is intact (skipped {names}{more}: rank 0 logs why), "
                f"{checked}; fix or remove them, or set FT_PLUGINS_RESUME_ALLOW_SCRATCH=1 to start from scratch",
                [(skipped.path, skipped.reason) for skipped in selection.skipped])
        else:
            log.warning("resume: no intact checkpoint in %s (%s); starting from scratch (allow_scratch is on)",
                        directory, checked)
        return selection

    def _agreed(self, directory: str, format: str, rank: int, gather: Gather) -> Selection:
        from ft_plugins.checkpoint.agreed import agreed_latest
        from ft_plugins.checkpoint.errors import CheckpointError
        from ft_plugins.checkpoint.layouts.mindspore import own_folder
        from ft_plugins.checkpoint.select import Search

        directory, search = own_folder(directory, rank), None
        if os.path.isdir(directory):
            try:
                search = Search(directory, format, deep=self.settings["deep"])
            except CheckpointError as exc:  # this rank still takes part: the others wait for its word
                log.warning("resume: cannot examine %s (%s); this rank offers no checkpoint", directory, exc)
        return agreed_latest(search, gather, directory)

    def commit(self, checkpoint: str) -> str | None:
        """Write the manifest of a finished save (a checkpoint directory once every rank finished, or one
        rank's MindSpore file once its save returned); a failure is logged, never raised into training."""
        if not self.settings["manifest"]:
            return None
        from ft_plugins.checkpoint.committing import commit as commit_checkpoint
        from ft_plugins.checkpoint.errors import CheckpointError

        try:
            path = commit_checkpoint(checkpoint, full=self.settings["full_checksum"])
        except (OSError, CheckpointError) as exc:
            log.warning("resume: could not commit %s: %s", checkpoint, exc)
            return None
        self.committed += 1
        return path

    def activity(self) -> str:
        if self.loaded is not None and self.loaded.path:
            loaded = f"resumed from {self.loaded.path} ({len(self.loaded.skipped)} newer skipped)"
        elif self.followed_iteration is not None:
            loaded = f"resumed iteration {self.followed_iteration}, as rank 0 chose"
        else:
            loaded = "nothing to resume from"
        return f"{loaded}; {self.committed} saves committed by this rank"


def check_time(started: float) -> str:
    """The newest-intact check's cost since ``started`` (``time.monotonic()``), said in the job's log: every
    restart pays it."""
    return f"checked in {time.monotonic() - started:.1f} s"
