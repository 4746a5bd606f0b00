"""``mstx`` for the Trainer and Accelerate: ``step {n}`` per optimizer step (from the Trainer's
``on_step_begin`` to its ``on_step_end``, n = steps completed before it, as for Megatron),
``dataloader`` around ``get_batch_samples`` (the fetch of one optimizer step's batches; transformers 4.46 on:
before, the Trainer fetches them inside its loop, and only the other ranges are emitted) and ``save_checkpoint``
around ``Trainer._save_checkpoint`` and ``Accelerator.save_state``."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from ft_plugins.features.mstx import DATALOADER, SAVE_CHECKPOINT, Mstx
from ft_plugins.patching import Patch
from ft_plugins.rank import is_rank_zero
from ft_plugins.torch.hf.targets import ACCELERATOR, TRAINER

log = logging.getLogger("ft_plugins.mstx")


class TrainerRanges:
    def __init__(self, mstx: Mstx) -> None:
        self.mstx = mstx
        self._step: Any = None
        self._started = False

    def patches(self) -> tuple[Patch, ...]:
        patches = []
        if self.mstx.emits(DATALOADER):
            patches.append(Patch(TRAINER, "Trainer.get_batch_samples", self._ranged(DATALOADER), required=False))
        if self.mstx.emits(SAVE_CHECKPOINT):
            patches += [Patch(TRAINER, "Trainer._save_checkpoint", self._ranged(SAVE_CHECKPOINT)),
                        Patch(ACCELERATOR, "Accelerator.save_state", self._ranged(SAVE_CHECKPOINT))]
        return tuple(patches)

    def on_event(self, event: str, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        if self._step is not None and event in ("step_end", "train_end", "step_begin"):
            self.mstx.end(self._step)
            self._step = None
        if event == "step_begin":
            self._step = self.mstx.begin_step(state.global_step)
            if not self._started:
                self._started = True
                self._say_what_is_not_ranged()

    def _say_what_is_not_ranged(self) -> None:
        """One line, on rank 0, when the Trainer has no batch fetch of its own to range (before transformers 4.46)."""
        trainer = getattr(sys.modules.get(TRAINER), "Trainer", None)
        if self.mstx.emits(DATALOADER) and not hasattr(trainer, "get_batch_samples") and is_rank_zero():
            import transformers

            log.info("mstx: no dataloader ranges on transformers %s: its Trainer fetches batches inside its loop "
                     "(Trainer.get_batch_samples, which they range, came with 4.46); step and save ranges as usual",
                     transformers.__version__)

    def _ranged(self, kind: str) -> Callable[..., Any]:
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            handle = self.mstx.begin(kind)
            try:
                return wrapped(*args, **kwargs)
            finally:
                self.mstx.end(handle)

        return wrapper
