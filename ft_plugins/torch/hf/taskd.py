"""``taskd`` for the Trainer and Accelerate: the TaskD worker starts once per process, with the global rank
and ``"pt"``, once torch.distributed is up. transformers creates the process group inside
``TrainingArguments`` (through accelerate's ``PartialState``), so the first ``Trainer`` or
``Accelerator`` built after that starts it; a process that imports ft_plugins later starts it at once."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from ft_plugins.features.taskd import Taskd
from ft_plugins.patching import Patch
from ft_plugins.rank import global_rank
from ft_plugins.torch.hf.targets import ACCELERATOR, TRAINER

log = logging.getLogger("ft_plugins.taskd")


def _initialized_rank() -> int | None:
    """The global rank once torch.distributed is up (the worker must not start before), else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return global_rank()
    return None


class WorkerStart:
    def __init__(self, taskd: Taskd) -> None:
        self.taskd = taskd

    def patches(self) -> tuple[Patch, ...]:
        self._start()  # ft_plugins imported after distributed init
        return (Patch(TRAINER, "Trainer.__init__", self._after),
                Patch(ACCELERATOR, "Accelerator.__init__", self._after))

    def _after(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        self._start()
        return result

    def _start(self) -> None:
        rank = _initialized_rank()
        if rank is None or self.taskd.worker.attempted:
            return
        try:
            self.taskd.start_worker(rank)
        except Exception as exc:  # never into training
            log.warning("taskd: worker start failed: %s: %s", type(exc).__name__, exc)
