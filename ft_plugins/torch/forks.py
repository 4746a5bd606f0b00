"""Forked children (a DataLoader's workers) never collect the objects they inherit.

A cycle of garbage the training process had not collected yet is collected again in each child it forks. Where
the cycle holds a torch object with threads of its own (a process group, a store), its destructor joins threads
that do not exist in the child: the worker hangs, or aborts ("Fatal Python error: Aborted" while
"Garbage-collecting"), and the step waits for its data. Such cycles come from a failed step's frames and from the
old groups ``recover`` and ``elastic`` leave, and a scale-in builds the data iterators again, forking new workers.
Python's own advice for a fork without exec: freeze the collector's objects right before the fork (constant time),
unfreeze them in the parent right after; the child's own objects are collected as ever.
"""

from __future__ import annotations

import gc
import os

_guarding = False  # set while ft_plugins' torch integration is enabled
_registered = False
_froze = False  # this fork froze the collector's objects (none were frozen before it)


def guard(on: bool) -> None:
    """Freeze the collector's objects at each fork of this process from now on (``on``), or no longer."""
    global _guarding, _registered
    _guarding = on
    if on and not _registered:  # an at-fork hook cannot be removed: it is registered once and reads the flag
        _registered = True
        os.register_at_fork(before=_freeze, after_in_parent=_thaw)


def _freeze() -> None:
    global _froze
    _froze = _guarding and gc.get_freeze_count() == 0  # a process that freezes objects itself keeps its own way
    if _froze:
        gc.freeze()


def _thaw() -> None:
    if _froze:
        gc.unfreeze()
