"""``hangs`` on MindSpore: each worker tells its launcher (msrun under ``ft-plugins run``) where it stands.

A step runs from its step begin to its step end, then "between steps" (``Model.train`` fetches the next batch
there); the run's ``ModelCheckpoint`` (MindFormers' ``CheckpointMonitor`` is one) saves in its step and train
ends, reported as a save; an evaluation inside ``Model.fit`` as one; after the last step, the end. Each report is
one write into a mapped file (:mod:`ft_plugins.progress`). Where no launcher watches, rank 0 says so once.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from mindspore.train import Callback, RunContext

from ft_plugins import progress
from ft_plugins.features.hangs import Hangs
from ft_plugins.mindspore.base import checkpoint_callback, global_rank, runtime_for
from ft_plugins.rank import is_rank_zero
from ft_plugins.runtime import Runtime

log = logging.getLogger("ft_plugins.hangs")

SAVING = ("on_train_step_end", "on_train_end")  # where ModelCheckpoint saves


class HangsCallback(Callback):
    """Reports this worker's sections to the launcher that watches it."""

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        super().__init__()
        self.watched = runtime_for("hangs", runtime, options).running(Hangs) is not None and \
            progress.start(global_rank() or 0)
        if not self.watched and is_rank_zero():
            log.warning("hangs: no launcher watches these workers (launch with `ft-plugins run -- msrun ...`, "
                        "hangs in FT_PLUGINS); a hang is not found")
        self._evaluation = ExitStack()

    def on_train_begin(self, run_context: RunContext) -> None:
        checkpoint = checkpoint_callback(run_context.original_args()) if self.watched else None
        for name in SAVING if checkpoint is not None else ():
            _report_as_save(checkpoint, name)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self.watched:
            progress.report(progress.STEP, run_context.original_args().cur_step_num)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.watched:
            progress.report(progress.BETWEEN, run_context.original_args().cur_step_num)

    def on_eval_begin(self, run_context: RunContext) -> None:
        self._evaluation.enter_context(progress.within(progress.EVAL))

    def on_eval_end(self, run_context: RunContext) -> None:
        self._evaluation.close()

    def on_train_end(self, run_context: RunContext) -> None:
        if self.watched:
            progress.report(progress.END)


def _report_as_save(callback: Any, name: str) -> None:
    """Wrap ``callback.<name>`` on the instance (never its class) in a save section; once."""
    method = getattr(callback, name)
    if getattr(method, "reports_save", False):
        return

    def reported(run_context: RunContext) -> Any:
        with progress.within(progress.SAVE):
            return method(run_context)

    reported.reports_save = True  # type: ignore[attr-defined]
    try:
        setattr(callback, name, reported)
    except (AttributeError, TypeError) as exc:  # a callback with __slots__: its saves count as steps
        log.info("hangs: %s's saves are not reported as saves (%s)", type(callback).__name__, exc)
