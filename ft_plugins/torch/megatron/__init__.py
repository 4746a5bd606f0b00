"""Hooks into ``megatron.training`` (megatron-core 0.8+, Megatron-LM) and MindSpeed-LLM's fork of it.

What the vendor guides edit into training.py by hand, done by wrapping megatron's functions, one
patch set per feature: ``initialize_megatron`` (taskd: the worker once distributed init is done),
``train_step`` / ``save_checkpoint`` (mstx: ``step {n}``, ``dataloader`` and ``save_checkpoint``
ranges), ``load_checkpoint`` / ``save_checkpoint`` (resume: :mod:`.resume`), ``validate_args``
(ttp's replicas: :mod:`.replicas`), the step, the optimizer's update, saves and loads (ttp's
engines: :mod:`.ttp`; fault drills: :mod:`.drill`), the step, saves and evaluations (hangs' progress
reports: :mod:`.hangs`), the step, saves and training's start and end (the job's events: :mod:`.recording`).
With any feature on, a finished gloo job drains its collectives and destroys its process group at exit
(``train``: :mod:`ft_plugins.torch.clean_exit`).
MindSpeed-LLM imports these by name from
megatron; the patcher rebinds those copies too.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.config import INJECT_VAR
from ft_plugins.features.hangs import Hangs
from ft_plugins.features.mstx import DATALOADER, SAVE_CHECKPOINT, Mstx
from ft_plugins.features.elastic import Elastic
from ft_plugins.features.recover import Recover
from ft_plugins.features.resume import Resume
from ft_plugins.features.taskd import Taskd
from ft_plugins.features.ttp import Ttp
from ft_plugins.patching import MissingSymbol, Patch, PatchSet
from ft_plugins.rank import global_rank, on_rank_zero
from ft_plugins.runtime import Runtime
from ft_plugins.torch.megatron.state import (CHECKPOINTING, INITIALIZE, MINDSPEED_LLM_TRAINING, OPTIMIZER, TRAINING,
                                             UPDATES, current_iteration, megatron_version)
from ft_plugins.vendors import versions

log = logging.getLogger("ft_plugins.torch")

SUPPORTED = (f"megatron-core >= {versions.MEGATRON_CORE} with megatron.training, "
             f"Megatron-LM core_r{versions.MEGATRON_CORE}+, MindSpeed-LLM 1.0+")


class MegatronIntegration:
    """The patch sets for the features that are on; ``apply``/``remove`` are symmetric and idempotent."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.patch_sets: list[PatchSet] = []
        taskd = runtime.running(Taskd)
        if taskd is not None:
            self._taskd = taskd
            self._add("taskd", Patch(INITIALIZE, "initialize_megatron", self._after_initialize))
        mstx = runtime.running(Mstx)
        if mstx is not None:
            self._mstx = mstx
            self._last_iterator: Any = None
            self._last_proxy: Any = None
            wrapper = self._train_step if mstx.emits(DATALOADER) else self._train_step_no_dataloader
            patches = [Patch(TRAINING, "train_step", wrapper),
                       Patch(MINDSPEED_LLM_TRAINING, "train_step", wrapper, required=False)]
            if mstx.emits(SAVE_CHECKPOINT):
                patches.append(Patch(CHECKPOINTING, "save_checkpoint", self._save_checkpoint))
            self._add("mstx", *patches)
        resume = runtime.running(Resume)
        if resume is not None:  # its glue imported with megatron's checkpointing, not in every process
            self.patch_sets.append(PatchSet("resume", lambda: _resume_patches(resume), self._missing, (CHECKPOINTING,)))
        if os.environ.get(INJECT_VAR, "").strip():
            from ft_plugins.torch.megatron.drill import FaultDrill

            drill = FaultDrill()  # before ttp: ttp has seen the step (or update) begin when a fault fires
            self._add("faults", Patch(TRAINING, "train_step", drill.train_step),
                      Patch(MINDSPEED_LLM_TRAINING, "train_step", drill.train_step, required=False),
                      *(Patch(OPTIMIZER, name, drill.update, required=False) for name in UPDATES[:2]),
                      Patch(CHECKPOINTING, "save_checkpoint", drill.save_checkpoint))
        ttp = runtime.running(Ttp)
        if ttp is not None:  # added after resume: its load wrapper commits before resume chooses
            from ft_plugins.torch.megatron.ttp import MegatronTtp

            glue = MegatronTtp(ttp, runtime.config.strict)
            self._recover(glue)  # inside ttp's step hook: a recovered step never reaches ttp's dump
            self._add("ttp", *glue.patches(), *_backend_note(glue.engine, runtime.running(Recover) is not None))
        if runtime.running(Hangs) is not None:  # last, so outermost: a step reported before a drill fires in it
            from ft_plugins.torch.megatron.hangs import MegatronProgress

            self._add("hangs", *MegatronProgress().patches())
        if events.recording():  # the outermost: a step repaired in place stays one step
            from ft_plugins.torch.megatron.recording import MegatronEvents

            self._add("events", *MegatronEvents().patches())
        self.clean_exit: Any = None
        if self.patch_sets:  # its glue imported with megatron's training loop, not in every process
            self.patch_sets.append(PatchSet("exit", self._clean_exit_patches, self._missing, (TRAINING,)))

    def _recover(self, ttp: Any) -> None:
        """``recover`` on ttp's engine: the built-in one's protocol, or MindIO's handlers (its step tracker, its
        dump as the fallback either way)."""
        recover, elastic = self.runtime.running(Recover), self.runtime.running(Elastic)
        if recover is None and elastic is not None:
            self._add("elastic", Patch(TRAINING, "pretrain", _elastic_needs_recover))
        if recover is None or ttp.engine is None:
            return
        if ttp.engine == "mindio":  # MindIO's controller drives the repair (and the scale-in) through its handlers
            if elastic is None:
                from ft_plugins.torch.megatron.mindio_recover import MindioRecovery

                ttp.mindio.recovery = MindioRecovery(recover, ttp)
            else:
                from ft_plugins.torch.megatron.mindio_elastic import MindioElastic

                ttp.mindio.recovery = MindioElastic(recover, ttp, elastic)
            self._add("recover", *ttp.mindio.recovery.patches())
        elif elastic is None:
            from ft_plugins.torch.megatron.recover import MegatronRecovery

            self._add("recover", *MegatronRecovery(recover, ttp).patches())
        else:
            from ft_plugins.torch.megatron.elastic import MegatronElastic

            self._add("recover", *MegatronElastic(recover, ttp, elastic).patches())

    def _clean_exit_patches(self) -> tuple[Patch, ...]:
        from ft_plugins.torch.clean_exit import CLEAN_EXIT

        self.clean_exit = CLEAN_EXIT
        return (Patch(TRAINING, "train", self.clean_exit.loop),
                Patch(MINDSPEED_LLM_TRAINING, "train", self.clean_exit.loop, required=False))

    def _add(self, feature: str, *patches: Patch) -> None:
        self.patch_sets.append(PatchSet(feature, patches, self._missing))

    def apply(self) -> None:
        for patch_set in self.patch_sets:
            patch_set.apply()
        if hasattr(self, "_taskd"):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():  # imported after distributed init
                self._start_worker()

    def remove(self) -> None:
        for patch_set in reversed(self.patch_sets):
            patch_set.remove()
        if self.clean_exit is not None:
            self.clean_exit.unregister()

    def _missing(self, patch_set: PatchSet, error: MissingSymbol) -> None:
        reason = f"{error} in megatron {megatron_version()}: this layout is not supported ({SUPPORTED})"
        if patch_set.name in self.runtime.features:
            self.runtime.disable(patch_set.name, reason)
        else:  # not a feature (the fire drill): said here, once
            log.warning("%s off: %s", patch_set.name, reason)

    def _start_worker(self) -> None:
        try:
            self._taskd.start_worker(global_rank())
        except Exception as exc:  # never into training
            log.warning("taskd: worker start failed: %s: %s", type(exc).__name__, exc)

    def _after_initialize(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        self._start_worker()
        return result

    def _ranged_iterator(self, data_iterator: Any) -> Any:
        """The ranged proxy for this iterator; megatron passes the same one every step, so keep it."""
        if data_iterator is not self._last_iterator:
            self._last_iterator, self._last_proxy = data_iterator, self._mstx.ranged(data_iterator)
        return self._last_proxy

    def _train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if "data_iterator" in kwargs:
            kwargs["data_iterator"] = self._ranged_iterator(kwargs["data_iterator"])
        elif len(args) > 1:
            args = (args[0], self._ranged_iterator(args[1]), *args[2:])
        return self._train_step_no_dataloader(wrapped, instance, args, kwargs)

    def _train_step_no_dataloader(self, wrapped: Callable[..., Any], instance: Any, args: tuple,
                                  kwargs: dict) -> Any:
        handle = self._mstx.begin_step(current_iteration(args, kwargs))
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._mstx.end(handle)

    def _save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        handle = self._mstx.begin(SAVE_CHECKPOINT)
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._mstx.end(handle)


def _resume_patches(resume: Resume) -> tuple[Patch, ...]:
    from ft_plugins.torch.megatron.resume import MegatronResume

    glue = MegatronResume(resume)
    return (Patch(CHECKPOINTING, "load_checkpoint", glue.load_checkpoint),
            Patch(CHECKPOINTING, "save_checkpoint", glue.save_checkpoint))


def _elastic_needs_recover(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Said as Megatron's training begins, not at import (a Trainer job imports this glue too)."""
    on_rank_zero(log.warning, "elastic: Megatron's scale-in works on top of recover, which is off: a lost rank takes "
                 "ttp's dump (FT_PLUGINS=ttp,recover,elastic)")
    return wrapped(*args, **kwargs)


def _backend_note(engine: str | None, recovering: bool) -> tuple[Patch, ...]:
    """The default group's backend said where the built-in engine (and ``recover`` on it) relies on its errors."""
    if engine != "builtin":
        return ()
    from ft_plugins.torch.backend import BackendNote

    return BackendNote("ttp's built-in engine" + (" and recover" if recovering else "")).patches()
