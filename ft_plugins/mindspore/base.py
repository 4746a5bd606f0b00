"""What every MindSpore callback of ft_plugins shares: the rank, the runtime, the run's checkpoint callback."""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from ft_plugins.rank import global_rank
from ft_plugins.runtime import Runtime, activate

__all__ = ["FRAMEWORK", "checkpoint_callback", "global_rank", "runtime_for", "save_root"]

FRAMEWORK = "ms"


def runtime_for(feature: str, runtime: Runtime | None, options: Mapping[str, Any]) -> Runtime:
    """The given runtime, or one activated for this feature alone (a single-feature callback used by itself)."""
    if runtime is not None:
        return runtime
    return activate(FRAMEWORK, features=feature, options={feature: dict(options)} if options else None)


def checkpoint_callback(cb_params: Any) -> Any:
    """The run's ``ModelCheckpoint`` (MindFormers' ``CheckpointMonitor`` is one): where checkpoints go."""
    from mindspore.train.callback import ModelCheckpoint

    return next((cb for cb in cb_params.list_callback if isinstance(cb, ModelCheckpoint)), None)


def save_root(directory: str) -> str:
    """The save directory holding every rank's checkpoints: MindFormers' CheckpointMonitor writes into ``rank_N``."""
    path = os.path.normpath(directory)
    return os.path.dirname(path) if re.fullmatch(r"rank_\d+", os.path.basename(path)) else path
