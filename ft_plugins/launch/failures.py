"""Which workers failed, recorded by torchrun's process (``ft-plugins run``) as the job's faults: who failed, not who
noticed.

torch's process context stops every worker at the first look that finds one failed (``SubprocessContext._poll``
closes the context, then counts the workers it stopped as failures too, for its log). So at the first close of a
context, its failures are the workers that failed by themselves: each is recorded as a ``fault`` the launcher saw,
with its global rank (the ``RANK`` torchrun gave it), exit code and, for a worker a signal ended, the signal; the
failures one look found share its time. A SIGKILLed worker writes nothing itself, and its peers, stopped by torchrun,
gasp after it: ``ft-plugins report`` names the rank from this record. A failure ``recover`` repairs in place never
reaches the close: recover's own look records it (one it cannot repair, there and again here).
"""

from __future__ import annotations

import logging
import signal
import time
import weakref
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.launch.leftovers import wrap_close

log = logging.getLogger("ft_plugins.launch")

_closed: "weakref.WeakSet[Any]" = weakref.WeakSet()  # process contexts closed once: later closes stop no failure


def install() -> bool:
    """Wrap torch's ``PContext.close`` with :func:`close`; never raises."""
    return wrap_close(close, "the job's events name no failed worker from torchrun")


def close(wrapped: Callable[..., Any], context: Any, args: tuple, kwargs: dict) -> Any:
    """The workers that made torch stop the others recorded (at a context's first close), then torch's close."""
    if context not in _closed:
        _closed.add(context)
        try:
            record(context)
        except Exception as exc:  # the stop goes on: the record is the report's, the stop the job's
            log.warning("the job's events name no failed worker from torchrun (%s: %s)", type(exc).__name__, exc)
    return wrapped(*args, **kwargs)


def record(context: Any) -> None:
    """A ``fault`` for each worker of ``context`` found failed so far (none: a stop for another reason)."""
    seen = round(time.time(), 4)
    for local_rank, failure in sorted(getattr(context, "_failures", {}).items()):
        code = failure.exitcode
        killed = {"signal": signal.Signals(-code).name} if -code in set(signal.Signals) else {}
        events.emit("fault", t=seen, rank=int(context.envs[local_rank]["RANK"]), kind=events.exit_kind(code),
                    code=code, **killed, pid=failure.pid, noticed="launcher")
