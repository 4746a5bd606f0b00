"""The launcher side: ``ft-plugins run`` puts :data:`BOOTSTRAP_DIR` first on ``PYTHONPATH`` so that
every Python process the command starts runs its ``sitecustomize`` (the ``opentelemetry-instrument``
way), which hands over to :mod:`ft_plugins.launch.roles`. ``environment`` plans the child's
variables (``LD_PRELOAD`` included); ``doctor`` and ``k8s`` check a node and edit a job file.
"""

import os
from typing import Mapping

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def without_bootstrap(value: str) -> str:
    """A ``PYTHONPATH`` without the bootstrap: for helper processes, which must not act as a worker."""
    return os.pathsep.join(p for p in value.split(os.pathsep) if p and os.path.abspath(p) != BOOTSTRAP_DIR)


def helper_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a helper process (a check, a probe, the manager): its ``PYTHONPATH`` without the bootstrap."""
    return dict(env, PYTHONPATH=without_bootstrap(env.get("PYTHONPATH", "")))


# where a helper ``python -c`` runs: the folder holding this ft_plugins. ``-c`` puts the current directory first on
# the path, so run where training runs a folder there named ``ft_plugins`` would be imported instead of this one.
HELPER_CWD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
