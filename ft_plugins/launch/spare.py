"""A warm spare of ``recover`` (``FT_PLUGINS_RECOVER_SPARES``): a process started ahead of any fault with the
interpreter up and torch and megatron imported, waiting to take over a lost rank.

    python -u -m ft_plugins.launch.spare SCRIPT ARGS...

The launcher (:mod:`ft_plugins.launch.recover`) starts it with a worker's environment and its command;
once imported it says so on its standard output (one line; its output goes to standard error after
that), then waits for one line on its standard
input: the lost worker's environment as JSON. It takes that environment, turns ft_plugins on again
with it and runs ``SCRIPT`` as the lost worker would have. End of input (the launcher gone): it exits.
Until it takes over it runs at the lowest CPU priority (:func:`lower_priority`).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import runpy
import sys
from typing import Callable

READY = "ft_plugins spare ready"
PRELOADED = ("torch", "torch.distributed", "megatron.training")
LOWEST = 19
CAP_SYS_NICE = 23


def may_raise_priority(nice: int) -> bool:
    """Whether this process may set its nice value back down to ``nice`` (CAP_SYS_NICE, or RLIMIT_NICE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return True
    with open("/proc/self/status", encoding="ascii") as status:
        effective = next((line.split()[1] for line in status if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) >> CAP_SYS_NICE & 1)


def lower_priority() -> Callable[[], None]:
    """The spare imports and waits at the lowest CPU priority, so that the ranks training on the same cores
    keep theirs (a spare started after a repair, importing torch and megatron beside 4 ranks on 2 cores, slowed
    them by about 1.5 s); the call returned gives every thread of the process the workers' priority back, at
    take-over. Where the process could not raise it back, nothing is lowered (a rank must not train at the
    lowest priority)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice >= LOWEST or not may_raise_priority(nice):
        return lambda: None
    os.setpriority(os.PRIO_PROCESS, 0, LOWEST)  # this thread; the threads it starts inherit it

    def restore() -> None:
        for task in os.listdir("/proc/self/task"):  # Linux keeps a nice value per thread
            try:
                os.setpriority(os.PRIO_PROCESS, int(task), nice)
            except OSError:  # the thread ended meanwhile
                continue

    return restore


def main() -> None:
    restore_priority = lower_priority()
    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    print(READY, flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # standard output was the readiness pipe; from now on the console
    line = sys.stdin.readline()
    if not line:
        return
    restore_priority()
    os.environ.update(json.loads(line))
    glue = sys.modules.get("ft_plugins.torch")
    if glue is not None:
        glue.enable()  # the lost worker's configuration and place in the recovery; its lines name that rank
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
