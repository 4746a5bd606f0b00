"""Hugging Face ``Trainer`` and Accelerate: the features of ``import ft_plugins.torch``, hooked when transformers /
accelerate are imported (before or after ft_plugins).

One module per feature, each one patch set over the framework-neutral core: :mod:`.mstx`, :mod:`.taskd`,
:mod:`.resume` (Trainer) and :mod:`.accelerate` (Accelerator), :mod:`.elastic` (the Trainer resumed by another
number of processes), :mod:`.ttp`, the job's events (:mod:`.recording`),
and the fire drills of ``FT_PLUGINS_INJECT_FAULT`` (:mod:`.drill`); the faults drill is applied before ``ttp``, so
``ttp`` has seen the step (or the update) begin when a fault fires. The Trainer's own events (step begin / end)
reach the features through :class:`FaultToleranceCallback`, which every Trainer gets once: added by the
``Trainer.__init__`` hook unless the user passed one already. With any feature on, a finished gloo job drains its
collectives and destroys its process group at exit (:mod:`ft_plugins.torch.clean_exit`).

``import ft_plugins.torch`` runs in every training process, most of which never import transformers: the glue of
``resume``, of the fire drills and of the exit (with the checkpoint choice, the store agreement and the fault plans
it brings) is imported when transformers or accelerate is, then patched as the others are.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ft_plugins import events as job_events
from ft_plugins.config import INJECT_VAR
from ft_plugins.features.elastic import Elastic
from ft_plugins.features.mstx import Mstx
from ft_plugins.features.resume import Resume
from ft_plugins.features.taskd import Taskd
from ft_plugins.features.ttp import Ttp
from ft_plugins.patching import MissingSymbol, Patch, PatchSet
from ft_plugins.runtime import Runtime
from ft_plugins.torch.hf import events
from ft_plugins.torch.hf.targets import ACCELERATOR, MODULES, TRAINER
from ft_plugins.vendors import versions

log = logging.getLogger("ft_plugins.torch")

SUPPORTED = versions.supported("transformers", "accelerate")


def _version(package: str) -> str:
    import sys

    return getattr(sys.modules.get(package), "__version__", "unknown version")


class HFIntegration:
    """The patch sets for the features that are on; ``apply``/``remove`` are symmetric and idempotent."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.patch_sets: list[PatchSet] = []
        self.listeners: list[Any] = []
        mstx = runtime.running(Mstx)
        if mstx is not None:
            from ft_plugins.torch.hf.mstx import TrainerRanges

            self._add("mstx", TrainerRanges(mstx))
        taskd = runtime.running(Taskd)
        if taskd is not None:
            from ft_plugins.torch.hf.taskd import WorkerStart

            self._add("taskd", WorkerStart(taskd))
        resume, elastic = runtime.running(Resume), runtime.running(Elastic)
        if resume is not None:
            self._defer("resume", lambda: _resume_parts(resume, said_only=elastic is None))
        if elastic is not None:
            self._defer("elastic", _elastic_parts)
        if os.environ.get(INJECT_VAR, "").strip():
            self._defer("faults", _drill_parts)
        ttp = runtime.running(Ttp)
        if ttp is not None and getattr(ttp, "engine", None) == "builtin":
            from ft_plugins.torch.hf.ttp import TrainerDump

            self._add("ttp", TrainerDump(ttp))
        if job_events.recording():
            from ft_plugins.torch.hf.accelerate_recording import AcceleratorEvents
            from ft_plugins.torch.hf.recording import TrainerEvents

            self._add("events", TrainerEvents(), AcceleratorEvents())
        self.clean_exit: Any = None
        if self.patch_sets:
            self.patch_sets.append(PatchSet("callback", (Patch(TRAINER, "Trainer.__init__", _add_callback),),
                                            self._missing))
            self.patch_sets.append(PatchSet("exit", self._clean_exit_patches, self._missing, MODULES))

    def _add(self, feature: str, *parts: Any) -> None:
        """``parts`` give ``patches()``; those with Trainer events (``on_step_begin`` ...) listen to them."""
        self.patch_sets.append(PatchSet(feature, _patches_of(parts), self._missing))
        self.listeners += [part for part in parts if hasattr(part, "on_event")]

    def _defer(self, feature: str, make_parts: Callable[[], tuple[Any, ...]]) -> None:
        """Parts made (their modules imported) when the first module of :data:`.targets.MODULES` is; they
        must not listen to Trainer events (listeners are known at ``apply``)."""
        self.patch_sets.append(PatchSet(feature, lambda: _patches_of(make_parts()), self._missing, MODULES))

    def _clean_exit_patches(self) -> tuple[Patch, ...]:
        from ft_plugins.torch.clean_exit import CLEAN_EXIT

        self.clean_exit = CLEAN_EXIT
        return (Patch(ACCELERATOR, "Accelerator.__init__", self.clean_exit.ready),
                Patch(TRAINER, "Trainer.train", self.clean_exit.loop))

    def apply(self) -> None:
        events.LISTENERS[:] = self.listeners
        for patch_set in self.patch_sets:
            patch_set.apply()

    def remove(self) -> None:
        for patch_set in reversed(self.patch_sets):
            patch_set.remove()
        events.LISTENERS.clear()
        if self.clean_exit is not None:
            self.clean_exit.unregister()

    def _missing(self, patch_set: PatchSet, error: MissingSymbol) -> None:
        package = str(error).split(".", 1)[0]
        self.runtime.disable(patch_set.name, f"{error} in {package} {_version(package)}: this layout is not "
                                             f"supported ({SUPPORTED})")


def _patches_of(parts: tuple[Any, ...]) -> tuple[Patch, ...]:
    return tuple(patch for part in parts for patch in part.patches())


def _resume_parts(resume: Resume, said_only: bool) -> tuple[Any, ...]:
    """``said_only``: a resume by another number of processes is said (``elastic`` is off: nothing keeps its
    global batch)."""
    from ft_plugins.torch.hf.accelerate import AcceleratorResume
    from ft_plugins.torch.hf.elastic import AcceleratorResize, TrainerResize
    from ft_plugins.torch.hf.resume import TrainerResume

    resize = (TrainerResize(keep=False), AcceleratorResize(keep=False)) if said_only else ()
    return TrainerResume(resume), AcceleratorResume(resume), *resize


def _elastic_parts() -> tuple[Any, ...]:
    from ft_plugins.torch.hf.elastic import AcceleratorResize, TrainerResize

    return TrainerResize(keep=True), AcceleratorResize(keep=True)


def _drill_parts() -> tuple[Any, ...]:
    from ft_plugins.torch.hf.drill import TrainerDrill

    return (TrainerDrill(),)


def _add_callback(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Trainer.__init__``: the Trainer gets one FaultToleranceCallback, unless it was given one."""
    result = wrapped(*args, **kwargs)
    from ft_plugins.torch.hf.callback import FaultToleranceCallback

    handler = getattr(instance, "callback_handler", None)
    if handler is not None and not any(isinstance(cb, FaultToleranceCallback) for cb in handler.callbacks):
        handler.add_callback(FaultToleranceCallback())
    return result
