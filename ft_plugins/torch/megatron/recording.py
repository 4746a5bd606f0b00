"""Megatron glue for the job's events (:mod:`ft_plugins.events`): set-up done and the end of training
(``train``), each step's start and end (``train_step``), each save's start and end with its step and, from rank 0,
its size (``save_checkpoint``). Outermost of the wrappers: a step repaired in place is one step here."""

from __future__ import annotations

import time
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.patching import Patch
from ft_plugins.rank import global_rank
from ft_plugins.torch.megatron.state import (CHECKPOINTING, MINDSPEED_LLM_TRAINING, TRAINING, current_iteration,
                                             megatron_args)


class MegatronEvents:
    """The wrappers (wrapt signature) that record a Megatron worker's moments."""

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINING, "train", self.train),
                Patch(MINDSPEED_LLM_TRAINING, "train", self.train, required=False),
                Patch(TRAINING, "train_step", self.train_step),
                Patch(MINDSPEED_LLM_TRAINING, "train_step", self.train_step, required=False),
                Patch(CHECKPOINTING, "save_checkpoint", self.save_checkpoint))

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        events.emit("setup_done")
        result = wrapped(*args, **kwargs)
        events.emit("trained")
        return result

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        started = time.time()
        result = wrapped(*args, **kwargs)
        events.step(current_iteration(args, kwargs) + 1, started)
        return result

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = args[0] if args else kwargs.get("iteration")
        events.emit("save_start", step=iteration)
        result = wrapped(*args, **kwargs)
        events.emit("save_end", step=iteration, bytes=_saved_bytes(iteration) if global_rank() == 0 else None)
        return result


def _saved_bytes(iteration: Any) -> int | None:
    """The size of the save of ``iteration`` on disk (every rank's part: rank 0 reads once the save returned)."""
    from ft_plugins.checkpoint.naming import iteration_dir

    save = getattr(megatron_args(), "save", None)
    if not save or not isinstance(iteration, int):
        return None
    return events.size_on_disk(iteration_dir(save, iteration))
