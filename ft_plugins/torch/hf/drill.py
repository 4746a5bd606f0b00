"""Fire drills in Trainer workers: the faults of ``FT_PLUGINS_INJECT_FAULT`` where they are named.

``step=N`` is the optimizer step that starts after N completed steps. ``at=forward`` fires as its first
micro-batch starts (``training_step``), ``at=update`` inside the optimizer's ``step`` (Accelerate's
``AcceleratedOptimizer.step``), ``at=save`` as the rank writes its own part of ``checkpoint-N`` (its RNG
file: ``_save_rng_state``, after the save's collective ``store_flos``), or as
Accelerate starts writing the files of ``checkpoint_N`` (``save_accelerator_state``: its folder exists,
older ones stock Accelerate pruned already), ``at=device`` as ``forward``, after a kernel of ``seconds`` is queued
on the CUDA stream (:func:`ft_plugins.torch.drill.stuck_kernel`). Independent of the features, like the Megatron drill:
the same drill runs with ``FT_PLUGINS=none`` to show what a fault costs without ft_plugins.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ft_plugins import faults
from ft_plugins.patching import Patch
from ft_plugins.torch.drill import stuck_kernel
from ft_plugins.torch.hf.rotation import number
from ft_plugins.torch.hf.targets import CHECKPOINTING, OPTIMIZER, TRAINER


class TrainerDrill:
    def __init__(self) -> None:
        self._drill = faults.Drill()
        self._step = 0

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINER, "Trainer.training_step", self.training_step),
                Patch(OPTIMIZER, "AcceleratedOptimizer.step", self.update),
                Patch(TRAINER, "Trainer._save_rng_state", self.save_checkpoint),
                Patch(CHECKPOINTING, "save_accelerator_state", self.save_state))

    def training_step(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        self._step = trainer.state.global_step
        self._drill.reached("forward", self._step)
        self._drill.reached("device", self._step, before=stuck_kernel)
        return wrapped(*args, **kwargs)

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._drill.reached("update", self._step)
        return wrapped(*args, **kwargs)

    def save_checkpoint(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        self._drill.reached("save", trainer.state.global_step)
        return wrapped(*args, **kwargs)

    def save_state(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._drill.reached("save", number(os.fspath(kwargs.get("output_dir", args[0] if args else ""))))
        return wrapped(*args, **kwargs)
