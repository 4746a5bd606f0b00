"""A warm spare of ``recover`` (``FT_PLUGINS_RECOVER_SPARES``): a process started ahead of any fault with the
interpreter up and torch and megatron imported, waiting to take over a lost rank.

    python -u -m ft_plugins.launch.spare SCRIPT ARGS...

The launcher (:mod:`ft_plugins.launch.recover`) starts it with a worker's environment and its command;
once imported it says so on its standard output (one line; its output goes to standard error after
that), then waits for one line on its standard
input: the lost worker's environment as JSON. It takes that environment, turns ft_plugins on again
with it and runs ``SCRIPT`` as the lost worker would have. End of input (the launcher gone): it exits.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

READY = "ft_plugins spare ready"
PRELOADED = ("torch", "torch.distributed", "megatron.training")


def main() -> None:
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
    os.environ.update(json.loads(line))
    glue = sys.modules.get("ft_plugins.torch")
    if glue is not None:
        glue.enable()  # the lost worker's configuration and place in the recovery; its lines name that rank
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
