"""``taskd``: start this process's TaskD worker after distributed init, with the global rank."""

from __future__ import annotations

import logging

from ft_plugins.config import Option, parse_positive_int
from ft_plugins.features.base import Feature
from ft_plugins.vendors.taskd import TaskdWorker, load_worker_api, patch_torchrun_agent, warn_without_manager

log = logging.getLogger("ft_plugins.taskd")


class Taskd(Feature):
    name = "taskd"
    summary = "TaskD worker for process recovery and slow-node profiling"
    options = (
        Option("disk_limit_mb", 5000, "disk budget in MB for TaskD's profiling output", parse_positive_int),
        Option("manager_wait_s", 60, "seconds torchrun's TaskD agent may wait for a manager before a warning",
               parse_positive_int),
    )

    def start(self) -> str:
        self.worker = TaskdWorker(load_worker_api(), self.settings["disk_limit_mb"])
        return "TaskD worker API found"

    def start_worker(self, rank: int | None) -> bool:
        """Start the worker once; ``rank=None`` means the caller could not tell the global rank."""
        if rank is None:
            if not self.worker.attempted:
                self.worker.attempted = True
                log.warning("taskd: cannot determine the global rank (distributed not initialized and "
                            "RANK unset); worker not started")
            return False
        return self.worker.start(rank, self.framework)

    def prepare_launcher(self, launcher: str) -> bool:
        """Launcher-side set-up, in the launcher process. msrun needs none: MindSpore's own process
        manager starts TaskD's plugin when ``MS_ENABLE_TFT`` asks for it."""
        if launcher != "torchrun":
            return False
        try:
            adapted = patch_torchrun_agent()
            warn_without_manager(self.settings["manager_wait_s"])
        except Exception as exc:  # the launcher must start regardless
            log.warning("taskd: torchrun agent patch not applied: %s", exc)
            return False
        fitted = f" (its launch_agent made to take {', '.join(adapted)} from this torch)" if adapted else ""
        log.debug("taskd: torchrun elastic agent patched for process recovery%s", fitted)  # the launcher's line says it
        return True

    def activity(self) -> str:
        if self.worker.started_rank is not None:
            return f"worker started on rank {self.worker.started_rank}"
        return "worker start attempted and failed" if self.worker.attempted else "worker not started yet"
