"""Accelerate glue for the job's events (:mod:`ft_plugins.events`) where no Trainer drives it (the Trainer's own are
:mod:`.recording`'s): set-up done at the first ``backward``, each step from its first ``backward`` to its optimizer
update (one that synchronized gradients), each ``save_state`` with its step and, from the main process, its size.

Accelerate keeps no step count of its own a save holds (its ``step`` counts gradient accumulation), so the steps are
numbered by the updates of this launch: a relaunch counts from 1 again, and the report's steps lost are the steps
a relaunch had to train again to stand where the fault found the job.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.patching import Patch
from ft_plugins.torch.hf.targets import ACCELERATOR, OPTIMIZER, TRAINER


class AcceleratorEvents:
    """The wrappers (wrapt signature) of ``backward``, the optimizer's ``step`` and ``save_state``."""

    def __init__(self) -> None:
        self.steps = 0
        self.began: float | None = None  # the step's first backward
        self.in_trainer = 0  # Trainer.train calls running: its steps and saves are the Trainer's to record

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(ACCELERATOR, "Accelerator.backward", self.backward),
                Patch(OPTIMIZER, "AcceleratedOptimizer.step", self.update),
                Patch(ACCELERATOR, "Accelerator.save_state", self.save_state),
                Patch(TRAINER, "Trainer.train", self.trainer, required=False))

    def trainer(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self.in_trainer += 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.in_trainer -= 1

    def backward(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.began is None and not self.in_trainer:
            if not self.steps:
                events.emit("setup_done")
            self.began = time.time()
        return wrapped(*args, **kwargs)

    def update(self, wrapped: Callable[..., Any], optimizer: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if self.began is not None and getattr(optimizer.gradient_state, "sync_gradients", True):
            self.steps += 1
            events.step(self.steps, self.began)
            self.began = None
        return result

    def save_state(self, wrapped: Callable[..., Any], accelerator: Any, args: tuple, kwargs: dict) -> Any:
        if self.in_trainer:
            return wrapped(*args, **kwargs)
        events.emit("save_start", step=self.steps)
        saved = wrapped(*args, **kwargs)
        size = events.size_on_disk(os.fspath(saved)) if accelerator.is_main_process and saved is not None else None
        events.emit("save_end", step=self.steps, bytes=size)
        return saved
