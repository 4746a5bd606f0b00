"""A finished gloo job's exit: every rank's collectives drained and the process group destroyed while the
interpreter still runs.

Stock, a finished 2-rank gloo Trainer job sometimes dies at exit with "terminate called without an active
exception" (SIGABRT; PyTorch issue 190489): a gloo worker thread drops its reference to the job's last
collective only after ``wait()`` returned, and when that is the last one, freeing the collective's tensors
needs the GIL; during ``Py_FinalizeEx`` the thread is ended by ``pthread_exit`` inside a noexcept
destructor. At exit (atexit, before finalization) a barrier, waited on with the GIL released, then a moment
more with the GIL released (``SETTLE``: the barrier returns as soon as the last collective completed, and the
worker thread that ran it may still be waiting for the GIL to let go of it: seen once in CI with the barrier
alone), give the workers that moment, and the group is destroyed. Registered once per process after
``Accelerator.__init__`` (the Trainer builds one) when the default group is gloo with more than one rank.
Nothing is done after an uncaught exception, when a ``Trainer.train`` of this process did not return (a script
leaving mid-training through ``sys.exit``: its peers still train, and a barrier would meet their next collective
and wait for gloo's timeout, 30 minutes by default, instead of letting them fail at once), or when the script
destroyed the group itself.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from typing import Any, Callable

from ft_plugins.patching import Patch
from ft_plugins.torch.hf.agree import distributed
from ft_plugins.torch.hf.targets import ACCELERATOR, TRAINER

log = logging.getLogger("ft_plugins.torch")

SETTLE = 0.1  # seconds of sleep (the GIL released) after the exit barrier, for the workers to let go


class CleanExit:
    def __init__(self) -> None:
        self.registered = False
        self.training = 0  # Trainer.train calls that began and did not return

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(ACCELERATOR, "Accelerator.__init__", self._after),
                Patch(TRAINER, "Trainer.train", self._train))

    def _after(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        dist = distributed()
        if not self.registered and dist is not None and dist.get_backend() == "gloo":
            atexit.register(self.drain)
            self.registered = True
        return result

    def _train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self.training += 1
        result = wrapped(*args, **kwargs)  # raised, even SystemExit: still counted as training at exit
        self.training -= 1
        return result

    def unregister(self) -> None:
        atexit.unregister(self.drain)
        self.registered = False

    def drain(self) -> None:
        """At exit: barrier, then destroy the default group; never raises (the job's result stands)."""
        dist = distributed()
        if dist is None or getattr(sys, "last_value", None) is not None:
            return
        if self.training:
            log.debug("exit: left inside Trainer.train; the process group is not drained (peers may train on)")
            return
        try:
            dist.barrier()
            time.sleep(SETTLE)
            dist.destroy_process_group()
        except Exception as exc:  # a peer gone after training: its own error is the one that counts
            log.debug("exit: process group not drained: %s: %s", type(exc).__name__, exc)
