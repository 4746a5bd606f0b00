"""torchrun's store as a meeting point that needs no collective (a survivor of a lost peer can still use it).

:func:`claim`: the first ``store.add`` of a key wins, so exactly one survivor writes each part of a
dying-gasp save, whatever the others are blocked in. :func:`distributed`: whether there are peers to meet.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("ft_plugins.ttp")


def distributed() -> Any:
    """``torch.distributed`` when this process runs in an initialized group of more than one rank, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


def claim(key: str) -> bool:
    """Whether this rank is the writer for ``key``: the first ``store.add`` on torchrun's store (which outlives
    every worker) wins. Without a reachable store every survivor writes.

    The claim goes to the store under every prefix: each group generation of ``recover`` (and its holding
    state) prefixes the default group's store differently, so survivors of different generations, claiming
    through their own prefix, would each have won, and the first to commit the dump took the other's
    half-written part into it."""
    try:
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return int(store.add(key, 1)) == 1
    except Exception as exc:
        log.debug("ttp: writer claim unavailable (%s: %s); writing anyway", type(exc).__name__, exc)
        return True
