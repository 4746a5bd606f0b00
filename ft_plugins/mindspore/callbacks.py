"""MindSpore ``Callback``s: thin event adapters over the framework-neutral features.

``FaultTolerance`` is the one entry (plain ``Model.train`` or a MindFormers YAML ``callbacks:``
item); it is made of the single-feature callbacks (one module each), which can also be used alone, and
records the job's events (:mod:`.recording`) for ``ft-plugins report``.
Every check that can refuse a feature runs before the first step: in strict mode it stops training
there, otherwise the feature is switched off with one warning and training proceeds.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from mindspore.train import Callback, RunContext

from ft_plugins.config import STRICT_VAR
from ft_plugins.mindspore.base import FRAMEWORK, global_rank
from ft_plugins.mindspore.mstx import StepRangesCallback
from ft_plugins.mindspore.recording import EventsCallback
from ft_plugins.mindspore.resume import ResumeCallback, SaveCommitter
from ft_plugins.mindspore.taskd import TaskdWorkerCallback
from ft_plugins.mindspore.ttp import TtpCallback, replica_problem
from ft_plugins.runtime import activate

__all__ = ["EventsCallback", "FaultTolerance", "ResumeCallback", "SaveCommitter", "StepRangesCallback",
           "TaskdWorkerCallback", "TtpCallback", "global_rank", "replica_problem"]


class FaultTolerance(Callback):
    """The one entry: the configured features (``FT_PLUGINS``, as on PyTorch) as one MindSpore callback.

    ``features``: ``"auto"``, ``"all"``, ``"none"``, a comma string or a list; default ``FT_PLUGINS``.
    ``strict``: refuse to train when a requested feature cannot work (default ``FT_PLUGINS_STRICT``).
    ``resume_dir`` / ``resume_format``: where to resume from (default: the run's checkpoint directory).
    Per-feature options as mappings, e.g. ``taskd={"disk_limit_mb": 2000}`` or in YAML::

        callbacks:
          - type: FaultTolerance
            features: taskd,mstx,ttp
            taskd: {disk_limit_mb: 2000}
    """

    def __init__(self, features: str | Sequence[str] | None = None, strict: bool | None = None,
                 resume_dir: str = "", resume_format: str = "auto", **options: Mapping[str, Any]) -> None:
        super().__init__()
        env = None if strict is None else {**os.environ, STRICT_VAR: "1" if strict else "0"}
        self.runtime = activate(FRAMEWORK, features=features, options=options, env=env)
        parts: list[Callback] = [EventsCallback(resume_dir)]  # first: its record holds what resume chooses
        if self.runtime.feature("resume") is not None:
            self.resume: ResumeCallback | None = ResumeCallback(resume_dir, resume_format, runtime=self.runtime)
            parts.append(self.resume)
        else:
            self.resume = None
        for name, part in (("taskd", TaskdWorkerCallback), ("ttp", TtpCallback), ("mstx", StepRangesCallback)):
            if self.runtime.feature(name) is not None:
                parts.append(part(runtime=self.runtime))
        self.parts = parts

    def initial_epoch(self, steps_per_epoch: int, dataset: Any = None) -> int:
        """See :meth:`ResumeCallback.initial_epoch`; 0 when resume is off."""
        return self.resume.initial_epoch(steps_per_epoch, dataset) if self.resume is not None else 0

    def on_train_begin(self, run_context: RunContext) -> None:
        for part in self.parts:
            part.on_train_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        for part in self.parts:
            part.on_train_step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        for part in reversed(self.parts):
            part.on_train_step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        for part in reversed(self.parts):
            part.on_train_end(run_context)

    def __exit__(self, *exc_info: object) -> None:
        for part in reversed(self.parts):
            part.__exit__(*exc_info)
