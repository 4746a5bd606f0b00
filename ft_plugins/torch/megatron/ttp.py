"""Megatron glue for ``ttp``'s two engines, composed from framework-neutral parts: the survivors save the
last completed step in Megatron's own layout, and the dump is committed.

- :class:`ft_plugins.steps.StepTracker`: the step's phases, the last completed step K, "inside the update";
- :class:`ft_plugins.torch.megatron.dump.MegatronDump`: the dump writer and its commit;
- the trigger: the built-in engine's :class:`ft_plugins.triggers.DyingGasp` (SIGTERM watcher, fatal
  exception), or MindIO's controller through :class:`ft_plugins.torch.megatron.mindio.MindioDriver`.

What it hooks, and why: ``train_step`` (the iteration starting with K completed steps, the objects a save
needs, the RNG state at the step boundary; a fatal exception inside the step dumps, then exits with code 1);
the optimizer's own update (``step_with_ready_grads`` of the fp32 / mixed-precision / chained optimizers: no
collective for the non-distributed optimizer, unlike the grad-norm all-reduce in ``step``), so a rank is
never dumped half-updated; ``save_checkpoint`` and ``load_checkpoint`` (the writer's); ``validate_args``
(the ``replicas`` option, :mod:`.replicas`). All of them are one patch set: a missing symbol turns the whole
feature off, with one line saying so.
"""

from __future__ import annotations

from typing import Any, Callable

from ft_plugins.features.ttp import Ttp
from ft_plugins.patching import Patch
from ft_plugins.steps import StepTracker
from ft_plugins.torch.megatron.dump import MegatronDump
from ft_plugins.torch.megatron.mindio import MindioDriver
from ft_plugins.torch.megatron.replicas import MegatronReplicas
from ft_plugins.torch.megatron.state import (CHECKPOINTING, INITIALIZE, MINDSPEED_LLM_TRAINING, OPTIMIZER, TRAINING,
                                             UPDATES, current_iteration)
from ft_plugins.triggers import EXIT_ON_ERROR, DyingGasp


class MegatronTtp:
    """The ``ttp`` wrappers (wrapt signature) for one engine: ``builtin``, ``mindio``, or None (replicas only)."""

    def __init__(self, feature: Ttp, strict: bool) -> None:
        self.feature = feature
        self.engine: str | None = getattr(feature, "engine", None)
        self.replicas = MegatronReplicas(feature.settings["replicas"], strict)
        self.tracker = StepTracker()
        self.writer = MegatronDump(feature)
        self.gasp = DyingGasp(self.tracker, self.writer.save)
        self.mindio = MindioDriver(feature, self.tracker, self.writer) if self.engine == "mindio" else None

    def patches(self) -> tuple[Patch, ...]:
        """Every hook of the feature, for its one patch set."""
        patches = [*self.replicas.patches()]
        if self.engine not in ("builtin", "mindio"):
            return tuple(patches)
        if self.mindio is not None:
            patches += [Patch(INITIALIZE, "_initialize_distributed", self.mindio.initialize_distributed),
                        Patch(TRAINING, "train", self.mindio.train),
                        Patch(MINDSPEED_LLM_TRAINING, "train", self.mindio.train, required=False)]
        # applied after resume's: its load wrapper commits before resume chooses
        return (*patches, Patch(TRAINING, "train_step", self.train_step),
                Patch(MINDSPEED_LLM_TRAINING, "train_step", self.train_step, required=False),
                *(Patch(OPTIMIZER, name, self.update, required=not name.startswith("Chained")) for name in UPDATES),
                Patch(CHECKPOINTING, "save_checkpoint", self.writer.save_checkpoint),
                Patch(CHECKPOINTING, "load_checkpoint", self.writer.load_checkpoint))

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.writer.refused(self.engine or ""):
            return wrapped(*args, **kwargs)
        iteration = current_iteration(args, kwargs)
        if self.mindio is None:
            self.gasp.watch_sigterm()
        self.writer.marks.mark()  # what the device runs before it is the last completed step's
        self.tracker.begin(iteration, self.writer.step(args, kwargs))
        try:
            result = wrapped(*args, **kwargs)
        except Exception as exc:
            if self.mindio is None:
                self.gasp.fire(f"{type(exc).__name__} in step {iteration + 1}", EXIT_ON_ERROR, exc)
            else:
                self.mindio.step_failed()
            raise
        completed = self.tracker.end(self.writer.advance)
        if self.mindio is not None:
            self.mindio.step_completed(completed)
        return result

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        call = self.writer.marks.after(lambda: wrapped(*args, **kwargs))
        return self.mindio.update(call) if self.mindio is not None else self.tracker.update(call)
