"""Make ft_plugins' start-up lines visible in training logs without taking over the user's logging."""

from __future__ import annotations

import logging
import os
import sys


def setup(level: str) -> None:
    """Give the ``ft_plugins`` logger a stderr handler unless the application configured logging.

    When the root logger already has handlers, records simply propagate there.
    """
    logger = logging.getLogger("ft_plugins")
    logger.setLevel(level.upper())
    if logger.handlers or logging.getLogger().handlers:
        return
    rank = next((os.environ[var] for var in ("RANK", "RANK_ID", "MS_NODE_ID") if os.environ.get(var)), None)
    if rank is None:  # no launcher's rank: a single-process job is rank 0, a larger one not yet known
        single = all(os.environ.get(var, "1") in ("", "1") for var in ("WORLD_SIZE", "MS_WORKER_NUM"))
        rank = "0" if single else "?"
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[%(name)s rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def exit_now(code: int) -> None:
    """Leave now: flush what was logged and written, then ``os._exit`` (no interpreter teardown: after a
    dying-gasp dump the main thread may sit in a collective that never returns)."""
    for handler in logging.getLogger().handlers + logging.getLogger("ft_plugins").handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            os.fsync(stream.fileno())
        except Exception:
            pass
    os._exit(code)
