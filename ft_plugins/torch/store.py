"""torchrun's store as a meeting point that needs no collective (a survivor of a lost peer can still use it).

:func:`claim`: the first ``store.add`` of a key wins, so exactly one survivor writes each part of a
dying-gasp save, whatever the others are blocked in.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ft_plugins.ttp")


def claim(key: str) -> bool:
    """Whether this rank is the writer for ``key``: the first ``store.add`` on torchrun's store (which outlives
    every worker) wins. Without a reachable store every survivor writes (each renames a whole file or
    directory into place, so that is only wasted work)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return int(_get_default_store().add(key, 1)) == 1
    except Exception as exc:
        log.debug("ttp: writer claim unavailable (%s: %s); writing anyway", type(exc).__name__, exc)
        return True
