"""Thin adapter over MindCluster's TaskD worker API (``taskd.api.taskd_worker_api``).

TaskD's functions return bool and log their own errors; this adapter adds what users got wrong
by hand: the real module versus the PyPI placeholder named ``taskd``, once-per-process start, and
never an exception into the training loop.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

from ft_plugins.vendors import VendorUnavailable

log = logging.getLogger("ft_plugins.taskd")

WORKER_MODULE = "taskd.api.taskd_worker_api"
TORCHRUN_AGENT_PATCH = "taskd.python.adaptor.patch"
FRAMEWORKS = ("pt", "ms")


def load_worker_api() -> ModuleType:
    """Import TaskD's worker API, or raise VendorUnavailable saying what is installed instead."""
    if importlib.util.find_spec("taskd") is None:
        raise VendorUnavailable("TaskD is not installed (install the taskd wheel shipped with MindCluster)")
    try:
        module = importlib.import_module(WORKER_MODULE)
    except ImportError as exc:
        placeholder = importlib.import_module("taskd")
        where = getattr(placeholder, "__file__", None) or "unknown location"
        raise VendorUnavailable(
            f"the installed 'taskd' ({where}) has no {WORKER_MODULE}: it is the PyPI placeholder, "
            "not Ascend's TaskD; uninstall it and install the taskd wheel shipped with MindCluster"
            f" ({exc})"
        ) from None
    missing = [name for name in ("init_taskd_worker", "start_taskd_worker") if not hasattr(module, name)]
    if missing:
        raise VendorUnavailable(f"{WORKER_MODULE} lacks {', '.join(missing)}: unsupported TaskD version")
    return module


class TaskdWorker:
    """Starts this process's TaskD worker exactly once; failures are logged, never raised."""

    def __init__(self, api: ModuleType, disk_limit_mb: int) -> None:
        self._api = api
        self._disk_limit_mb = disk_limit_mb
        self.started_rank: int | None = None
        self.attempted = False

    def start(self, rank: int, framework: str) -> bool:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
        if self.attempted:
            return self.started_rank is not None
        self.attempted = True
        try:
            if not self._api.init_taskd_worker(rank, self._disk_limit_mb, framework):
                log.warning("taskd: init_taskd_worker(rank=%d) returned False; worker not started", rank)
                return False
            if not self._api.start_taskd_worker():
                log.warning("taskd: start_taskd_worker() returned False on rank %d", rank)
                return False
        except Exception as exc:  # a vendor failure must never stop training
            log.warning("taskd: worker start on rank %d failed: %s: %s", rank, type(exc).__name__, exc)
            return False
        self.started_rank = rank
        log.info("taskd: worker started (rank %d, framework %s, disk limit %d MB)",
                 rank, framework, self._disk_limit_mb)
        return True


def patch_torchrun_agent() -> None:
    """Import TaskD's patch of torch's elastic agent; it must run inside the torchrun process itself,
    before the agent starts (what the vendor guide does with a ``sed`` into torch/distributed/run.py)."""
    try:
        importlib.import_module(TORCHRUN_AGENT_PATCH)
    except ImportError as exc:
        raise VendorUnavailable(f"{TORCHRUN_AGENT_PATCH} cannot be imported ({exc}); TaskD 7.0 or newer ships it") from None
