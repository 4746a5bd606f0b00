"""The launcher side of ``hangs`` under msrun: torchrun's :class:`~.watchdog.Watchdog`, in a thread of msrun.

msrun's process manager (``mindspore.parallel.cluster.process_entity._api._ProcessManager``) starts the workers
and polls them once a second; when one exits with an error it SIGKILLs every other worker (``ttp``'s survivors
write on the lost peer first) and the job ends, for its relaunch to resume. Once the manager started its
workers, a thread of the msrun process reads their progress every ``INTERVAL`` seconds. For a hang it logs the
hung rank's stacks, SIGTERMs it and SIGKILLs it (after the grace if it answers SIGTERM): msrun then meets its death
as any other. For every rank stalled alike it SIGTERMs every local worker (each writes its ``ttp`` dump), SIGKILL
after the grace to those that answer it, at once to the others.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping

from ft_plugins import progress
from ft_plugins.launch.stalls import ALL, Verdict
from ft_plugins.launch.watchdog import Watchdog, answering, stop
from ft_plugins.launch.watchdog import install as install_watchdog

log = logging.getLogger("ft_plugins.hangs")

MANAGER = "mindspore.parallel.cluster.process_entity._api"
INTERVAL = 0.1  # seconds between two reads, as torchrun's default monitoring round


class MsrunWatch:
    """Starts the watchdog thread once msrun's process manager started its workers."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.thread: threading.Thread | None = None

    def install(self) -> None:
        from ft_plugins.patching import when_imported

        when_imported(MANAGER, self._patch)

    def _patch(self, module: Any) -> None:
        import wrapt

        manager = module._ProcessManager  # noqa: SLF001
        manager.start_workers = wrapt.FunctionWrapper(manager.start_workers, self._started)

    def _started(self, wrapped: Any, manager: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, args=(manager,), name="ft_plugins-hangs", daemon=True)
            self.thread.start()
        return result

    def _watch(self, manager: Any) -> None:
        while True:
            time.sleep(INTERVAL)
            try:
                self.look(manager, time.monotonic())
            except Exception as exc:  # the thread goes on: msrun's own loop is untouched either way
                log.warning("hangs: progress not read this round (%s: %s)", type(exc).__name__, exc)

    def look(self, manager: Any, now: float) -> Verdict | None:
        """One round over the manager's running workers; every rank stalled alike is stopped as a whole."""
        procs = running_workers(manager, self.watchdog.directory)
        if not procs:
            return None
        verdict = self.watchdog.look(procs, manager.worker_num > manager.local_worker_num, now)
        if verdict is not None and verdict.kind == ALL:  # each writes its dump: those that answer get the grace
            stop(list(procs.values()), self.watchdog.grace,
                 answering(self.watchdog.directory, {proc.pid: rank for rank, proc in procs.items()}))
        return verdict


def running_workers(manager: Any, directory: str) -> dict[int, Any]:
    """The manager's running worker processes by global rank, numbered as msrun numbers them; with ranks
    assigned by the cluster (several nodes, no ``--node_rank``), by the rank each worker reported."""
    reported: dict[int, int] = {}
    if manager.local_worker_num != manager.worker_num and manager.node_rank < 0:
        for name in os.listdir(directory):
            record = progress.read(directory, int(name)) if name.isdigit() else None
            if record is not None:
                reported[record.pid] = int(name)
    procs = {}
    for index, proc in dict(manager.proc_rank_map).items():
        if proc.poll() is not None:
            continue
        if manager.local_worker_num == manager.worker_num:
            procs[index] = proc
        elif manager.node_rank >= 0:
            procs[manager.node_rank * manager.local_worker_num + index] = proc
        elif proc.pid in reported:
            procs[reported[proc.pid]] = proc
    return procs


def install(settings: Mapping[str, Any]) -> bool:
    """Called in the msrun launcher when ``hangs`` is on; never raises (msrun then runs as usual)."""
    return install_watchdog(settings, lambda dog: MsrunWatch(dog).install(), "msrun's process manager")
