"""Trainer glue for :mod:`ft_plugins.events`, as :mod:`ft_plugins.torch.megatron.recording` is Megatron's:
training under way (its first step begins: the model built, any checkpoint loaded) and its end, each optimizer step,
each save with its step and, from the process that writes the Trainer's state, its size. Accelerate's own loop, without
a Trainer: :mod:`.accelerate_recording`."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.patching import Patch
from ft_plugins.torch.hf.targets import TRAINER


class TrainerEvents:
    """A listener of the Trainer's events and the wrapper (wrapt signature) of its save."""

    def __init__(self) -> None:
        self._step_began: float | None = None

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINER, "Trainer._save_checkpoint", self.save_checkpoint),)

    def on_event(self, event: str, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        if event == "step_begin":
            if self._step_began is None:
                events.emit("setup_done")
            self._step_began = time.time()
        elif event == "step_end" and self._step_began is not None:
            events.step(state.global_step, self._step_began)
        elif event == "train_end":
            events.emit("trained")

    def save_checkpoint(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        step = trainer.state.global_step
        events.emit("save_start", step=step)
        result = wrapped(*args, **kwargs)
        trial = kwargs.get("trial", args[1] if len(args) > 1 else None)
        saved = os.path.join(trainer._get_output_dir(trial=trial), f"checkpoint-{step}")
        events.emit("save_end", step=step, bytes=events.size_on_disk(saved) if trainer.args.should_save else None)
        return result

