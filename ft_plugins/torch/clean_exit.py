"""A finished gloo job's exit: every rank's collectives drained and the process group destroyed while the
interpreter still runs.

Stock, a finished multi-rank gloo job sometimes dies at exit with "terminate called without an active
exception" (SIGABRT; PyTorch issue 190489), seen with the Hugging Face Trainer and with Megatron's
``pretrain()``: a gloo worker thread drops its reference to the job's last collective only after ``wait()``
returned, and when that is the last one, freeing the collective's tensors needs the GIL; during
``Py_FinalizeEx`` the thread is ended by ``pthread_exit`` inside a noexcept destructor. At exit (atexit, before
finalization) a barrier, waited on with the GIL released, then a moment more with the GIL released
(``SETTLE``: the barrier returns as soon as the last collective completed, and the worker thread that ran it
may still be waiting for the GIL to let go of it: seen once in CI with the barrier alone), give the workers
that moment, and the group is destroyed.

Registered once per process, with more than one rank, when the framework's distributed set-up returns
(:meth:`CleanExit.ready`: ``Accelerator.__init__``, which the Trainer calls) or a training loop begins, and done if
the default group is gloo at exit (a replacement for a lost rank starts on a holding backend and joins the job's
gloo groups later). Nothing is done after an uncaught exception, when a training loop of this process
(:meth:`CleanExit.loop`: ``Trainer.train``, Megatron's ``train``) did not return (a script leaving mid-training
through ``sys.exit``, or a survivor's dump: its peers still train or are gone, and a barrier would meet their next
collective and wait for gloo's timeout, 30 minutes by default, instead of letting them fail at once), or when the
script destroyed the group itself. One :data:`CLEAN_EXIT` per process, whichever frameworks it imported: one drain,
one count of the loops running.
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
from typing import Any, Callable

from ft_plugins.torch.store import distributed

log = logging.getLogger("ft_plugins.torch")

SETTLE = 0.1  # seconds of sleep (the GIL released) after the exit barrier, for the workers to let go


class CleanExit:
    """Two wrappers for each framework's patch set to place: :meth:`loop` on its training loop, :meth:`ready` on
    its distributed set-up where a script may use that without the loop (Accelerate)."""

    def __init__(self) -> None:
        self.registered = False
        self.training = 0  # training loop calls that began and did not return

    def ready(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        self._register()
        return result

    def loop(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._register()
        self.training += 1
        result = wrapped(*args, **kwargs)  # raised, even SystemExit: still counted as training at exit
        self.training -= 1
        return result

    def _register(self) -> None:
        if not self.registered and distributed() is not None:
            atexit.register(self.drain)
            self.registered = True

    def unregister(self) -> None:
        atexit.unregister(self.drain)
        self.registered = False

    def drain(self) -> None:
        """At exit: barrier, then destroy the default group; never raises (the job's result stands)."""
        dist = distributed()
        if dist is None or dist.get_backend() != "gloo" or getattr(sys, "last_value", None) is not None:
            return
        if self.training:
            log.debug("exit: left inside the training loop; the process group is not drained (peers may train on)")
            return
        try:
            dist.barrier()
            time.sleep(SETTLE)
            dist.destroy_process_group()
        except Exception as exc:  # a peer gone after training: its own error is the one that counts
            log.debug("exit: process group not drained: %s: %s", type(exc).__name__, exc)


CLEAN_EXIT = CleanExit()
