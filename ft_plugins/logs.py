"""Make ft_plugins' start-up lines visible in training logs without taking over the user's logging."""

from __future__ import annotations

import logging
import os
import sys

from ft_plugins import events
from ft_plugins.rank import env_rank


HANDLER = "ft_plugins"


def setup(level: str) -> None:
    """Give the ``ft_plugins`` logger a stderr handler unless the application configured logging.

    When the root logger already has handlers, records simply propagate there. Called again (a warm spare
    turned into a lost rank), the handler made here names the rank the process is now.
    """
    logger = logging.getLogger("ft_plugins")
    logger.setLevel(level.upper())
    rank = env_rank()  # the launcher's word: the handler is made before any framework is initialized
    formatter = logging.Formatter(f"[%(name)s rank {'?' if rank is None else rank}] %(levelname)s %(message)s")
    for handler in logger.handlers:
        if handler.name == HANDLER:
            handler.setFormatter(formatter)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.name = HANDLER
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.propagate = False


def exit_now(code: int) -> None:
    """Leave now: flush what was logged and written, then ``os._exit`` (no interpreter teardown: after a
    dying-gasp dump the main thread may sit in a collective that never returns)."""
    events.end(code)
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
