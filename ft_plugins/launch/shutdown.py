"""The grace ``ft-plugins run`` gives the workers before any SIGKILL: long enough for their dump.

Estimated from the write speed this job's own saves recorded in its ``--save`` directory
(:mod:`ft_plugins.grace`), never under the launcher's own default; ``--grace`` (or torchrun's own
``--shutdown-timeout``) overrides it. torchrun applies its shutdown timeout only when it is signalled:
when a worker dies, the survivors are stopped with a fixed 30 s (torch's process context closes the
others at the first failure, and its agent's ``_stop_workers`` again), so in the torchrun process
:func:`install` makes every close of the workers' process context wait the grace. A grace not given is
estimated again at each close, from what the job's saves recorded since its start: a first launch has
nothing measured, and its first periodic save is what the estimate then needs. msrun gives no grace at
all: when a worker failed it SIGKILLs every other worker's process group at its next poll, 0 to 1 s after
the death (``_ProcessManager.kill_worker_processes``); in the msrun process that kill becomes SIGTERM to
the same groups, the grace, then msrun's SIGKILL. A grace not given follows what the MindSpore workers
report after each save in a directory of this launch (:meth:`ft_plugins.mindspore.speed.WriteSpeed.warn`).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ft_plugins import grace as estimates
from ft_plugins.launch.leftovers import PROCESSES
from ft_plugins.launch.process import GRACE, wait_gone

log = logging.getLogger("ft_plugins.launch")

MSRUN_MANAGER = "mindspore.parallel.cluster.process_entity._api"  # _ProcessManager.kill_worker_processes()


@dataclass(frozen=True)
class Grace:
    """The seconds the workers get, the variables that give them, the start-up line, and a warning if short."""

    seconds: float
    changes: dict[str, str]
    line: str
    warning: str | None = None


def plan(command: Sequence[str], env: Mapping[str, str], asked: float | None, msrun: bool,
         reports: str | None = None) -> Grace:
    """The grace for ``command`` (``asked``: ``--grace``), from the write its ``--save`` directory recorded; for
    msrun from what its workers report in ``reports`` (an empty directory of this launch's: a MindSpore job
    names no save directory on its command line, and its dump writes every rank's file)."""
    save_dir = reports if msrun else estimates.save_dir_of(command)
    found = estimates.measured(save_dir)
    given = asked if asked is not None or msrun else estimates.shutdown_given(command, env)
    default = GRACE if msrun else estimates.TORCHRUN_GRACE
    seconds = given if given is not None else estimates.grace_for(found, default)
    changes = {estimates.GRACE_VAR: f"{seconds:g}"}
    if given is None and save_dir:
        changes[estimates.GRACE_FOLLOWS_VAR] = save_dir
    if not msrun and given is None:
        changes[estimates.SHUTDOWN_VAR] = str(int(seconds))
    if found is not None:
        what = estimates.describe(found)
    elif msrun:
        what = ("what a dump needs is reported by the workers after a save"
                f"{', and raises the grace to it' if save_dir else ''}")
    elif save_dir:
        what = (f"no write measured yet in {save_dir} (its first periodic save or dump records one"
                f"{'' if given is not None else ', and raises the grace to what it needs'})")
    else:
        what = "no --save directory in the command: no write measured"
    line = f"dying gasp: {what}; the workers get {seconds:g} s after SIGTERM before SIGKILL"
    short = given is not None and found is not None and estimates.needed(found) > seconds  # not given: the cap's line
    warning = (f"dying gasp: the grace of {seconds:g} s you set is shorter than the dump needs "
               f"({estimates.needed(found):.0f} s): a dump then is cut short" if short else None)
    return Grace(seconds, changes, line, warning)


def install(launcher: str = "torchrun", env: Mapping[str, str] | None = None) -> bool:
    """In the launcher process: every stop of the workers waits ``FT_PLUGINS_GRACE`` seconds before SIGKILL,
    torchrun's whatever torch passes, msrun's when one worker failed; never raises (the launcher then stops
    workers as it would)."""
    env = os.environ if env is None else env
    if estimates.GRACE_VAR not in env:
        return False
    try:
        planned = Planned(float(env[estimates.GRACE_VAR]), env.get(estimates.GRACE_FOLLOWS_VAR))
        if launcher == "msrun":
            from ft_plugins.patching import when_imported

            def patch(module: Any) -> None:
                _wrap(module._ProcessManager, "kill_worker_processes", planned.msrun_kill)  # noqa: SLF001

            when_imported(MSRUN_MANAGER, patch)
        else:
            import importlib

            _wrap(importlib.import_module(PROCESSES).PContext, "close", planned.torch_close)
    except Exception as exc:
        log.warning("%s keeps its own stop of the workers (%s: %s)", launcher, type(exc).__name__, exc)
        return False
    return True


def _wrap(owner: Any, name: str, replacement: Callable[..., Any]) -> None:
    import wrapt

    setattr(owner, name, wrapt.FunctionWrapper(getattr(owner, name), replacement))


class Planned:
    """The grace planned at start (``FT_PLUGINS_GRACE``); where it was not given (``follows``: the ``--save``
    directory), raised at each stop to what the job's writes recorded since, and said when it changes."""

    def __init__(self, seconds: float, follows: str | None) -> None:
        self.said = [seconds]
        self.follows = follows

    def seconds(self) -> float:
        found = estimates.measured(self.follows)
        seconds = estimates.grace_for(found, self.said[0])
        if found is not None and seconds != self.said[-1]:
            self.said.append(seconds)
            log.warning("dying gasp: %s; the workers get %g s after SIGTERM before SIGKILL",
                        estimates.describe(found), seconds)
        return seconds

    def torch_close(self, wrapped: Callable[..., Any], _context: Any, args: tuple, kwargs: dict) -> Any:
        death_sig = kwargs.pop("death_sig", args[0] if args else None)
        extra = {} if death_sig is None else {"death_sig": death_sig}
        return wrapped(**extra, timeout=self.seconds())

    def msrun_kill(self, wrapped: Callable[..., Any], manager: Any, args: tuple, kwargs: dict) -> Any:
        """SIGTERM to each running worker's process group (msrun's SIGKILL goes to the group), the grace for
        them to be gone, then msrun's own kill of what is left, and SIGKILL to what the gone ones left in
        their groups."""
        running = [proc for proc in manager.cgn_processes if proc.poll() is None]
        groups = [group for group in map(_group, running) if group is not None]
        if groups:
            seconds = self.seconds()
            found = estimates.measured(self.follows)
            log.warning("msrun stops the other workers: SIGTERM, SIGKILL after %g s for their dying gasp%s", seconds,
                        f" ({estimates.describe(found)})" if found is not None else "")
            _signal_groups(groups, signal.SIGTERM)
            wait_gone(running, seconds)
        result = wrapped(*args, **kwargs)
        _signal_groups(groups, signal.SIGKILL)
        return result


def _group(proc: Any) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except ProcessLookupError:
        return None


def _signal_groups(groups: list[int], sig: int) -> None:
    for group in groups:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass
