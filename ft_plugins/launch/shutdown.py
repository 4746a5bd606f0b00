"""The grace ``ft-plugins run`` gives the workers before any SIGKILL: long enough for their dump.

Estimated from the write speed this job's own saves recorded in its ``--save`` directory
(:mod:`ft_plugins.grace`), never under the launcher's own default; ``--grace`` (or torchrun's own
``--shutdown-timeout``) overrides it. torchrun applies its shutdown timeout only when it is signalled:
when a worker dies, the survivors are stopped with a fixed 30 s (torch's process context closes the
others at the first failure, and its agent's ``_stop_workers`` again), so in the torchrun process
:func:`install` makes every close of the workers' process context wait the grace. A grace not given is
estimated again at each close, from what the job's saves recorded since its start: a first launch has
nothing measured, and its first periodic save is what the estimate then needs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ft_plugins import grace as estimates
from ft_plugins.launch.process import GRACE

log = logging.getLogger("ft_plugins.launch")

PROCESSES = "torch.distributed.elastic.multiprocessing.api"  # PContext.close(death_sig, timeout=30)


@dataclass(frozen=True)
class Grace:
    """The seconds the workers get, the variables that give them, the start-up line, and a warning if short."""

    seconds: float
    changes: dict[str, str]
    line: str
    warning: str | None = None


def plan(command: Sequence[str], env: Mapping[str, str], asked: float | None, msrun: bool) -> Grace:
    """The grace for ``command`` (``asked``: ``--grace``), from the write its ``--save`` directory recorded."""
    save_dir = estimates.save_dir_of(command)
    found = estimates.measured(save_dir)
    given = asked if asked is not None or msrun else estimates.shutdown_given(command, env)
    default = GRACE if msrun else estimates.TORCHRUN_GRACE
    seconds = given if given is not None else estimates.grace_for(found, default)
    changes = {estimates.GRACE_VAR: f"{seconds:g}"}
    if not msrun and given is None:
        changes[estimates.SHUTDOWN_VAR] = str(int(seconds))
        if save_dir:
            changes[estimates.GRACE_FOLLOWS_VAR] = save_dir
    if found is not None:
        what = estimates.describe(found)
    elif save_dir:
        what = (f"no write measured yet in {save_dir} (its first periodic save or dump records one"
                f"{'' if msrun or given is not None else ', and raises the grace to what it needs'})")
    else:
        what = "no --save directory in the command: no write measured"
    line = f"dying gasp: {what}; the workers get {seconds:g} s after SIGTERM before SIGKILL"
    short = found is not None and estimates.needed(found) > seconds
    warning = (f"dying gasp: the grace of {seconds:g} s you set is shorter than the dump needs "
               f"({estimates.needed(found):.0f} s): a dump then is cut short" if short else None)
    return Grace(seconds, changes, line, warning)


def install(env: Mapping[str, str] | None = None) -> bool:
    """In the torchrun process: every stop of the workers waits ``FT_PLUGINS_GRACE`` seconds before SIGKILL,
    whatever torch passes; never raises (torchrun then stops workers as it would)."""
    env = os.environ if env is None else env
    if estimates.GRACE_VAR not in env:
        return False
    try:
        seconds = float(env[estimates.GRACE_VAR])
        import importlib

        import wrapt

        context = importlib.import_module(PROCESSES).PContext
        context.close = wrapt.FunctionWrapper(context.close, _waiting(seconds, env.get(estimates.GRACE_FOLLOWS_VAR)))
    except Exception as exc:
        log.warning("torchrun's agent keeps its own shutdown timeout (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def _waiting(planned: float, follows: str | None) -> Callable[..., Any]:
    said = [planned]

    def close(wrapped: Callable[..., Any], _context: Any, args: tuple, kwargs: dict) -> Any:
        death_sig = kwargs.pop("death_sig", args[0] if args else None)
        extra = {} if death_sig is None else {"death_sig": death_sig}
        found = estimates.measured(follows)
        seconds = estimates.grace_for(found, planned)
        if found is not None and seconds != said[-1]:  # a grace not planned at the start: said when it changes
            said.append(seconds)
            log.warning("dying gasp: %s; the workers get %g s after SIGTERM before SIGKILL",
                        estimates.describe(found), seconds)
        return wrapped(**extra, timeout=seconds)

    return close
