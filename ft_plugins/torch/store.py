"""torchrun's store as a meeting point that needs no collective (a survivor of a lost peer can still use it).

:func:`claim`: the first ``store.add`` of a key wins, so exactly one survivor writes each part of a
dying-gasp save, whatever the others are blocked in. :func:`agreed`: the first value offered for a key, the same
for every caller. :func:`distributed`: whether there are peers to meet.
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


def _root_store() -> Any:
    """The default group's store without its prefixes: torchrun's own, the same under every group generation."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def agreed(key: str, mine: str) -> str:
    """The value the first caller offered for ``key`` on torchrun's store, which every caller gets; empty without a
    store that can say (one process alone, a store without ``compare_set``): the same for every caller then."""
    try:
        return _root_store().compare_set(key, "", mine).decode()
    except Exception as exc:
        log.debug("ttp: no store to agree on %s (%s: %s)", key, type(exc).__name__, exc)
        return ""


def counted(key: str) -> int | None:
    """How many callers have counted ``key`` on torchrun's store (which outlives every worker), this one included;
    None without a reachable store.

    The count goes to the store under every prefix: each group generation of ``recover`` (and its holding state)
    prefixes the default group's store differently, so survivors of different generations, counting through their
    own prefix, would each have been first, and the first to commit the dump took the other's half-written part
    into it."""
    try:
        return int(_root_store().add(key, 1))
    except Exception as exc:
        log.debug("ttp: no store to count %s on (%s: %s)", key, type(exc).__name__, exc)
        return None


def claim(key: str) -> bool:
    """Whether this rank is the writer for ``key``: the first to count it wins. Without a reachable store every
    survivor writes."""
    return counted(key) in (1, None)
