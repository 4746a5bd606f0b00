"""Checkpoints of Megatron, MindSpore, MindFormers, Hugging Face and plain torch: choose the newest intact
one, verify one, commit a finished save.

Framework-neutral: this package imports no framework and never unpickles. This face only names what the
submodules offer and imports each on first use, so importing one submodule (e.g. :mod:`.atomic` to write
a file whole) runs nothing else: :mod:`.select` chooses and verifies, :mod:`.committing` commits,
:mod:`.manifest` records, :mod:`.layouts` knows each framework's layout, :mod:`.naming` Megatron's names
and tracker, :mod:`.dump` dying-gasp dumps, :mod:`.errors` every error (rooted at :class:`CheckpointError`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ft_plugins.checkpoint.committing import commit
    from ft_plugins.checkpoint.errors import CheckpointError, ManifestError, NoIntactCheckpoint
    from ft_plugins.checkpoint.layouts import FORMATS
    from ft_plugins.checkpoint.manifest import manifest_name, write_manifest
    from ft_plugins.checkpoint.select import Selection, Skipped, Verdict, find_latest, verify

# name -> submodule holding it
_LAZY = {
    "CheckpointError": "errors", "ManifestError": "errors", "NoIntactCheckpoint": "errors",
    "FORMATS": "layouts",
    "Selection": "select", "Skipped": "select", "Verdict": "select", "find_latest": "select", "verify": "select",
    "commit": "committing",
    "manifest_name": "manifest", "write_manifest": "manifest",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
