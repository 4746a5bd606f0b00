"""The calls ``ft-plugins patch`` writes into source files that monkeypatching cannot reach.

Each call is safe anywhere: it activates the configured features on first use (same
``FT_PLUGINS`` configuration as ``import ft_plugins.torch``), does nothing for features that
are off, and never raises into the training loop.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ft_plugins.config import ConfigError
from ft_plugins.features.mstx import Mstx
from ft_plugins.features.taskd import Taskd
from ft_plugins.runtime import Runtime, activate, current

log = logging.getLogger("ft_plugins")


def _runtime(framework: str) -> Runtime | None:
    runtime = current(framework)
    if runtime is not None:
        return runtime
    try:
        return activate(framework)
    except ConfigError as exc:
        log.error("%s; ft_plugins is off in this process", exc)
        return None


def _env_rank() -> int | None:
    for var in ("RANK", "RANK_ID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def start_taskd_worker(rank: int | None = None, framework: str = "pt") -> bool:
    """Start this process's TaskD worker once, with the global rank (default: RANK / RANK_ID)."""
    runtime = _runtime(framework)
    taskd = runtime.feature("taskd") if runtime else None
    if not isinstance(taskd, Taskd):
        return False
    return taskd.start_worker(_env_rank() if rank is None else rank)


class _Range:
    __slots__ = ("_mstx", "_message", "_handle")

    def __init__(self, mstx: Mstx | None, message: str) -> None:
        self._mstx = mstx
        self._message = message
        self._handle: Any = None

    def __enter__(self) -> "_Range":
        if self._mstx is not None:
            self._handle = self._mstx.begin(self._message)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._mstx is not None:
            self._mstx.end(self._handle)


class _StepRange(_Range):
    __slots__ = ()

    def __enter__(self) -> "_StepRange":
        if self._mstx is not None:
            self._handle = self._mstx.begin_step(int(self._message))
        return self


def _mstx(framework: str) -> Mstx | None:
    runtime = _runtime(framework)
    feature = runtime.feature("mstx") if runtime else None
    return feature if isinstance(feature, Mstx) else None


def step_range(iteration: int, framework: str = "pt") -> _Range:
    """``with step_range(n):`` around one training step: the ``step {n}`` range on the device stream."""
    return _StepRange(_mstx(framework), str(iteration))


def named_range(name: str, framework: str = "pt") -> _Range:
    """``with named_range("save_checkpoint"):``; names in use: dataloader, save_checkpoint, forward."""
    return _Range(_mstx(framework), name)
