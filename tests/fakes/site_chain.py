"""For the ``sitecustomize`` of a folder put first on a job's ``PYTHONPATH`` (``slow_disk``, ``exit_probe``):
Python imports one ``sitecustomize``, so the next one on the path after that folder (a side install's, e.g.
megatron-core 0.19's shim) is run too, as it would be without the folder. Loaded by its file's location: the
folders holding it are not on the job's path (the vendor fakes beside it would be)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def run_the_shadowed_sitecustomize(folder: str) -> None:
    """Only entries after ``folder`` are searched: an earlier one (``ft-plugins run``'s bootstrap) chain-loaded
    this one."""
    entries = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    later = sys.path[entries.index(folder) + 1:] if folder in entries else sys.path
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
