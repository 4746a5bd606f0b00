"""One decision for every rank, without a collective: rank 0 decides and posts it on torchrun's store,
the other ranks read it. A call made on rank 0 alone (a script that asks only on its main process)
therefore never hangs, and a call before distributed init decides locally."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from ft_plugins.faults import RESTART_VAR
from ft_plugins.torch.store import distributed


def agree(topic: str, decide: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's ``decide()`` on every rank (a JSON-able dict); ``topic`` must name the same question on
    every rank. Only rank 0 calls ``decide``."""
    dist = distributed()
    if dist is None:
        return decide()
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    key = f"ft_plugins/hf/{os.environ.get(RESTART_VAR, '0')}/{topic}"
    if dist.get_rank() == 0:
        decision = decide()
        store.set(key, json.dumps(decision))
        return decision
    return dict(json.loads(store.get(key)))


def barrier() -> None:
    """Every rank's part of a save is written once this returns (a no-op in a single process)."""
    dist = distributed()
    if dist is not None:
        dist.barrier()

