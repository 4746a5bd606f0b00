"""Make ft_plugins' start-up lines visible in training logs without taking over the user's logging."""

from __future__ import annotations

import logging

from ft_plugins.rank import env_rank


def setup(level: str) -> None:
    """Give the ``ft_plugins`` logger a stderr handler unless the application configured logging.

    When the root logger already has handlers, records simply propagate there.
    """
    logger = logging.getLogger("ft_plugins")
    logger.setLevel(level.upper())
    if logger.handlers or logging.getLogger().handlers:
        return
    rank = env_rank()  # the launcher's word: the handler is made before any framework is initialized
    handler = logging.StreamHandler()
    shown = "?" if rank is None else rank
    handler.setFormatter(logging.Formatter(f"[%(name)s rank {shown}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
