"""Communicators aborted where the backend blocks: on NCCL and HCCL a survivor's collective with a lost rank never
fails (the kernel waits on the device for data that never comes, and the host waits on it); only an abort releases
it. gloo fails at once, and torch's ``fake`` backend runs nothing: they are left alone.

Two moments abort: the launcher's announcement that a worker was lost (:class:`LossWatch`, for ``recover``: the
survivor's collective then fails as it does on gloo, and the repair goes on as there), and a dying gasp (before the
dump reads any state: device work queued behind a blocked collective would wait with it). ``ProcessGroup.abort()``
is torch's own, what NVIDIA's in-process restart and torchft call. On HCCL the NPU is first stopped and restarted
(its memory kept), as MindIO's stop and clean do, so that no HCCL task still waits on the device.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from ft_plugins.recovery import ABORT, key
from ft_plugins.vendors import mindio

log = logging.getLogger("ft_plugins.torch")

FAIL_FAST = ("gloo", "fake")  # a collective with a lost peer raises (gloo), or none runs (torch's fake backend)
WATCH_BOUND = 3600.0  # seconds one wait on the store lasts before the watch waits again


def blocks(backend: str) -> bool:
    """Whether a collective on ``backend`` (torch's name: ``nccl``, ``cpu:gloo,cuda:nccl``, ``hccl`` ...) waits for
    a lost peer until aborted: every backend but those of :data:`FAIL_FAST`, an unknown one included."""
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    return any(name not in FAIL_FAST for name in names if name)


def default_blocks() -> bool:
    """Whether this process's default group is on a backend that :func:`blocks` (False without one)."""
    import torch.distributed as dist

    try:
        return dist.is_available() and dist.is_initialized() and blocks(str(dist.get_backend()))
    except Exception:  # a default group torn down under way (recover's hold)
        return False


def abort_blocking(why: str) -> int:
    """Abort every process group of this process whose backend :func:`blocks` (torch's bookkeeping of them is left
    to whoever destroys them); how many were aborted. Never raises: a group that cannot abort is said."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    groups = [(group, str(backend)) for group, (backend, _store) in list(dist.distributed_c10d._world.pg_map.items())
              if blocks(str(backend))]
    if any("hccl" in backend.lower() for _, backend in groups):
        _stop_npu(why)
    aborted, started = 0, time.monotonic()
    for group, backend in groups:
        try:
            group.abort()
            aborted += 1
        except Exception as exc:
            log.warning("a %s group not aborted (%s): %s: %s", backend, why, type(exc).__name__, exc)
    if aborted:
        log.warning("aborted this rank's %d communicator%s (%s) in %.2f s", aborted, "s" if aborted > 1 else "", why,
                    time.monotonic() - started)
    return aborted


def abort_for_dump(reason: str) -> None:
    """Before a dump reads any state, on a backend that blocks: device copies would queue behind a blocked
    collective (nothing to do on gloo)."""
    if default_blocks():
        abort_blocking(f"ttp's dump: {reason}")


def _stop_npu(why: str) -> None:
    """MindIO's order, through its adapter: the NPU stopped (every pending task ends), then restarted."""
    try:
        if mindio.stop_device():
            mindio.restart_device()
    except Exception as exc:
        log.warning("the NPU not stopped and restarted (%s): %s: %s", why, type(exc).__name__, exc)


class LossWatch:
    """A daemon thread that aborts this rank's communicators when the launcher announces a lost worker or node
    (``recover``'s key :data:`~ft_plugins.recovery.ABORT` of the generation after the one ``current()`` names), waited
    on over a store connection of its own (``connect()``). Once it aborted, it waits for the repair (or the scale-in)
    to take that generation, then watches the next."""

    def __init__(self, connect: Callable[[], Any], current: Callable[[], int]) -> None:
        self.connect, self.current = connect, current
        self.started = False

    def start(self) -> None:
        """Once, where the default group's backend blocks."""
        if self.started or not default_blocks():
            return
        self.started = True
        threading.Thread(target=self._watch, name="ft_plugins-loss-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            store = self.connect()
        except Exception as exc:
            log.warning("recover: a lost worker will not abort this rank's communicators (no store: %s: %s)",
                        type(exc).__name__, exc)
            return
        while True:
            generation = self.current() + 1
            began = time.monotonic()
            try:
                store.wait([key(generation, ABORT)], timedelta(seconds=WATCH_BOUND))
            except Exception as exc:
                if time.monotonic() - began < 0.9 * WATCH_BOUND:  # the store failed, not the bound: the job ends
                    log.debug("recover: the loss watch ends: %s: %s", type(exc).__name__, exc)
                    return
                continue
            if self.current() < generation:
                abort_blocking(f"the launcher reports {store.get(key(generation, ABORT)).decode()} (generation "
                               f"{generation})")
            while self.current() < generation:  # the repair takes it (or the fallback ends the process)
                time.sleep(0.05)
