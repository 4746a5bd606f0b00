"""This process's global rank, worked out one way everywhere (hooks, glue, logs, callbacks).

Order of precedence: an initialized torch process group, then initialized MindSpore communication
(each asked only when the process already imported it: nothing here imports a framework), then the
launchers' variables (torchrun's ``RANK``, msrun's ``RANK_ID`` / ``MS_NODE_ID``), then 0 for a
single-process job. None: a multi-process job whose rank is not known yet.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping

RANK_VARS = ("RANK", "RANK_ID", "MS_NODE_ID")
WORLD_VARS = ("WORLD_SIZE", "MS_WORKER_NUM")


def _framework_rank() -> int | None:
    distributed = sys.modules.get("torch.distributed")
    try:
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            return int(distributed.get_rank())
    except Exception:  # a torch half torn down at exit: fall back to the launcher's word
        pass
    management = sys.modules.get("mindspore.communication.management")
    comm = getattr(management, "GlobalComm", None)
    try:
        if comm is not None and comm.INITED:
            return int(management.get_rank())
    except Exception:
        pass
    return None


def env_rank(env: Mapping[str, str] | None = None) -> int | None:
    """The rank the launcher gave this process, None when it gave none; a single-process job is rank 0."""
    env = os.environ if env is None else env
    for var in RANK_VARS:
        value = env.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0 if all(env.get(var, "1").strip() in ("", "1") for var in WORLD_VARS) else None


def global_rank() -> int | None:
    """The global rank (see the module's docstring for the order), None when not known yet."""
    found = _framework_rank()
    return found if found is not None else env_rank()


def is_rank_zero() -> bool:
    """Whether this process speaks for the job: rank 0, or a process whose rank is unknown (a launcher)."""
    return global_rank() in (0, None)


def on_rank_zero(emit: Callable[..., None], message: str, *values: Any) -> None:
    """One line per job, not per rank (every rank decides the same): ``emit`` it on rank zero only."""
    if is_rank_zero():
        emit(message, *values)
