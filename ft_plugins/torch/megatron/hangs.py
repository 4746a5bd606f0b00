"""Megatron glue for ``hangs``: each worker tells its launcher where it stands (:mod:`ft_plugins.progress`).

``train_step`` is a step (its iteration, then "between steps" once it returned; the wait for each batch from
its data iterator is data loading), ``save_checkpoint`` a save, ``evaluate`` an evaluation, and what follows
``train`` (final evaluation and save, exit) the end, each with its own bound at the launcher. ``ttp``'s dump
and ``recover``'s repair report their own sections from the core; torch's collectives are counted
(:mod:`ft_plugins.torch.collective_counts`). Where no launcher watches (no
``ft-plugins run -- torchrun``), rank 0 says so once and nothing is reported.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import wrapt

from ft_plugins import progress
from ft_plugins.patching import Patch
from ft_plugins.rank import env_rank, is_rank_zero
from ft_plugins.torch.collective_counts import CollectiveCounts
from ft_plugins.torch.megatron.state import CHECKPOINTING, MINDSPEED_LLM_TRAINING, TRAINING, current_iteration

log = logging.getLogger("ft_plugins.hangs")


class MegatronProgress:
    """The wrappers (wrapt signature) that report a Megatron worker's sections."""

    def __init__(self) -> None:
        self._iterator: Any = None
        self._proxy: Any = None
        self.watched = progress.start(env_rank() or 0)
        if not self.watched and is_rank_zero():
            log.warning("hangs: no launcher watches these workers (launch with `ft-plugins run -- torchrun ...`, "
                        "hangs in FT_PLUGINS); a hang is not found")

    def patches(self) -> tuple[Patch, ...]:
        if not self.watched:
            return ()
        return (*CollectiveCounts().patches(),
                Patch(TRAINING, "train", self.train),
                Patch(MINDSPEED_LLM_TRAINING, "train", self.train, required=False),
                Patch(TRAINING, "train_step", self.train_step),
                Patch(MINDSPEED_LLM_TRAINING, "train_step", self.train_step, required=False),
                Patch(CHECKPOINTING, "save_checkpoint", self.save_checkpoint),
                Patch(TRAINING, "evaluate", self.evaluate, required=False))

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        progress.report(progress.END)
        return result

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = current_iteration(args, kwargs) + 1
        if "data_iterator" in kwargs:
            kwargs["data_iterator"] = self._reported(kwargs["data_iterator"])
        elif len(args) > 1:
            args = (args[0], self._reported(args[1]), *args[2:])
        progress.report(progress.STEP, iteration)
        result = wrapped(*args, **kwargs)
        progress.report(progress.BETWEEN, iteration)
        return result

    def _reported(self, data_iterator: Any) -> Any:
        """The reporting proxy of this iterator; megatron passes the same one every step, so it is kept."""
        if data_iterator is None or isinstance(data_iterator, list):  # none, or one per virtual pipeline stage
            return data_iterator
        if data_iterator is not self._iterator:
            self._iterator, self._proxy = data_iterator, _DataReported(data_iterator)
        return self._proxy

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        with progress.within(progress.SAVE):
            return wrapped(*args, **kwargs)

    def evaluate(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        with progress.within(progress.EVAL):
            return wrapped(*args, **kwargs)


class _DataReported(wrapt.ObjectProxy):  # type: ignore[misc]
    """An iterator proxy: data loading reported around ``next``; every other attribute passes through."""

    def __iter__(self) -> "_DataReported":
        return self

    def __next__(self) -> Any:
        progress.report(progress.DATA)
        try:
            return next(self.__wrapped__)
        finally:
            progress.report(progress.STEP)
