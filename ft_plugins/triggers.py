"""What fires a dying gasp, framework-neutral: SIGTERM (a watcher thread) or a fatal exception, then one
save of the last completed step and the exit. :class:`DyingGasp` composes a :class:`~ft_plugins.steps.StepTracker`
with any save function (Megatron's dump writer, a Hugging Face save); the MindIO engine drives the same
tracker and writer through MindIO's handlers instead.

SIGTERM: a watcher thread woken through ``signal.set_wakeup_fd`` (a Python handler alone runs only once a
blocked gloo collective returns); the previous handler (e.g. Megatron's ``--exit-signal-handler``) still runs.
After a save: flush, fsync, ``os._exit`` (exiting through the interpreter without tearing the process group
down sometimes aborts).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from typing import Any, Callable

from ft_plugins import events, progress
from ft_plugins.logs import exit_now
from ft_plugins.steps import AlreadyFrozen, Frozen, StepTracker

log = logging.getLogger("ft_plugins.ttp")

EXIT_ON_ERROR, EXIT_ON_SIGTERM = 1, 128 + signal.SIGTERM
UPDATE_WAIT = 10.0  # seconds a save waits for a rank past its update to finish the step (or to fail)

Save = Callable[[str, "Frozen | None"], None]  # (reason, the frozen step or None) -> writes, never raises


class DyingGasp:
    """One save of the last completed step, from whichever trigger fires first, then the exit."""

    def __init__(self, tracker: StepTracker, save: Save, wait: float = UPDATE_WAIT) -> None:
        self.tracker = tracker
        self.save = save
        self.wait = wait
        self._watching = False

    def fire(self, reason: str, code: int, error: BaseException | None = None) -> None:
        """Freeze the tracker, save once (further callers wait for the first: the main thread parks), exit."""
        ignore_children()  # from here the process ends, whichever trigger saves
        try:
            frozen = self.tracker.freeze(self.wait)
        except AlreadyFrozen:
            return
        progress.report(progress.DUMP)
        events.emit("gasp", reason=reason, kind="exception" if error else "signal",
                    completed=frozen.completed if frozen else None)
        if error is not None:
            log.error("ttp: %s", "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.save(reason, frozen)
        exit_now(code)

    def watch_sigterm(self) -> None:
        """Once, from the main thread: SIGTERM fires the save, whatever the main thread is blocked in."""
        if self._watching or threading.current_thread() is not threading.main_thread():
            return
        self._watching = True
        watch_signal(signal.SIGTERM, lambda: self.fire("SIGTERM", EXIT_ON_SIGTERM), "ft_plugins-ttp-sigterm")


def ignore_children() -> None:
    """In a process that is about to exit, from its main thread: a child's end no longer raises there.
    torchrun stops a worker's whole process group, data loader workers included, and torch's SIGCHLD
    handler raises their end in the main thread: in the middle of a dump, or of a wait on MindIO."""
    if threading.current_thread() is threading.main_thread():
        # the default action, not a Python handler that does nothing: no system call of the dump is interrupted
        # (EINTR) by the children's ends. A SIGCHLD that came just before is reported by Python as "ignored due to
        # race condition", a traceback that stops nothing.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def watch_signal(signum: int, act: Callable[[], None], name: str) -> None:
    """Call ``act`` in a thread of its own when ``signum`` arrives, a signal that ends the process; the
    previous handler still runs (late, in the main thread). Call from the main thread. A process has one
    wakeup descriptor: one set before (an asyncio loop's, another library's) still gets every signal's byte."""
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    previous = signal.getsignal(signum)

    def chained(received: int, frame: Any) -> None:  # runs late in the main thread; the watcher acts
        ignore_children()  # the watcher's save runs in another thread: its ``fire`` cannot do this there
        if callable(previous):
            previous(received, frame)

    signal.signal(signum, chained)
    before = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            received = os.read(reader, 64)
            _pass_on(before, received)
            if signum in received:
                progress.report(progress.DUMP)  # at once: a launcher ending this rank sees the signal answered
                act()

    threading.Thread(target=watch, name=name, daemon=True).start()


def _pass_on(descriptor: int, received: bytes) -> None:
    """Write the signals' bytes to the wakeup descriptor set before ours (none: -1), as Python would have,
    never blocking: a full or closed one loses them, as it would."""
    if descriptor < 0:
        return
    try:
        os.write(descriptor, received)
    except OSError:
        pass
