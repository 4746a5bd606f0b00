"""What a failed torchrun worker leaves behind, ended at every stop of the workers.

torchrun's stop (``SubprocessContext._close``) signals only the workers still running. A worker that died leaves
what it started in its process group (torch starts each worker in a session of its own: the group is the worker's
pid, and lasts while any member runs): a data loader worker forked as its parent was killed takes init for its
parent and runs on, after the job and across a ``--max-restarts`` restart, holding its device's memory and the
job's output. In the torchrun process (``ft-plugins run``, or torch's ``run.py`` patched by ``ft-plugins patch``),
each close of the workers' process context ends with a SIGKILL of every failed worker's group; the groups of
workers that ended well are left as torchrun leaves them (a child a worker leaves running on purpose). msrun's stop
under ``run`` does the same: :meth:`ft_plugins.launch.shutdown.Planned.msrun_kill`.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Callable

log = logging.getLogger("ft_plugins.launch")

PROCESSES = "torch.distributed.elastic.multiprocessing.api"  # PContext.close(death_sig, timeout=30)


def install() -> bool:
    """Wrap torch's ``PContext.close`` with :func:`close`; never raises."""
    return wrap_close(close, "torchrun's stop leaves what failed workers started running")


def wrap_close(wrapper: Callable[..., Any], lost: str) -> bool:
    """Wrap torch's ``PContext.close`` with ``wrapper`` (wrapt signature; imported here: this runs in the torchrun
    process only); never raises: where it cannot, says ``lost`` and why."""
    try:
        import importlib

        import wrapt

        context = importlib.import_module(PROCESSES).PContext
        context.close = wrapt.FunctionWrapper(context.close, wrapper)
    except Exception as exc:
        log.warning("%s (%s: %s)", lost, type(exc).__name__, exc)
        return False
    return True


def close(wrapped: Callable[..., Any], context: Any, args: tuple, kwargs: dict) -> Any:
    """torch's close of the workers, then the end of what the failed ones left."""
    result = wrapped(*args, **kwargs)
    for handler in list(getattr(context, "subprocess_handlers", {}).values()):
        if handler.proc.poll() not in (None, 0):
            end_group(handler)
    return result


def end_group(handler: Any) -> None:
    """SIGKILL what is left in the process group of a torchrun worker that failed (its ``SubprocessHandler``)."""
    try:
        handler.close(death_sig=signal.SIGKILL)
    except ProcessLookupError:  # nothing was left
        pass
