"""Megatron's on-disk checkpoint naming, owned here alone: ``iter_{K:07d}`` directories (``_tmp`` for a
dying-gasp dump in progress) and the tracker file naming the last complete save (MindFormers' newer
layout uses the same tracker file). Resume, the dump commit and the glue all read it from here.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ft_plugins.checkpoint.atomic import atomic_file
from ft_plugins.checkpoint.reading import open_regular

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
TMP_SUFFIX = "_tmp"
# Megatron formats iterations with 7 digits and keeps counting past them: any number of digits is read
ITERATION_DIR = re.compile(r"^iter_(\d+)(_tmp)?$")


def iteration_dir(save_dir: str, iteration: int) -> str:
    """Where Megatron saves ``iteration``: ``<save>/iter_{K:07d}``."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def dump_dir(save_dir: str, iteration: int) -> str:
    """Where a dying-gasp dump of ``iteration`` is written before its commit renames it."""
    return iteration_dir(save_dir, iteration) + TMP_SUFFIX


def parse_iteration_dir(name: str) -> tuple[int, bool] | None:
    """``(K, is_dump_in_progress)`` for an ``iter_*`` name, None for any other name."""
    match = ITERATION_DIR.match(name)
    return (int(match.group(1)), bool(match.group(2))) if match else None


class Tracker(NamedTuple):
    """The tracker's content: ``value`` is an iteration, ``"release"`` or None (absent or unusable);
    ``problem`` says why an existing tracker is unusable."""

    value: int | str | None
    problem: str = ""


def read_tracker(save_dir: str) -> Tracker:
    """Read ``save_dir``'s tracker (a few bytes, a regular file only)."""
    path = os.path.join(save_dir, TRACKER)
    try:
        with open_regular(path) as handle:
            raw = handle.read(64)
    except FileNotFoundError:
        return Tracker(None)
    except OSError as exc:
        return Tracker(None, f"tracker cannot be read ({exc.strerror or exc})")
    text = raw.decode("ascii", "replace").strip()
    if text == RELEASE:
        return Tracker(RELEASE)
    if text.isdigit():
        return Tracker(int(text))
    return Tracker(None, f"tracker content {text[:20]!r} is neither an iteration number nor 'release'")


def tracker_iteration(save_dir: str) -> int | None:
    """The iteration the tracker names; None when it is absent, ``release`` or unusable."""
    value = read_tracker(save_dir).value
    return value if isinstance(value, int) else None


def advance_tracker(save_dir: str, iteration: int, durable: bool = True) -> None:
    """Point the tracker at ``iteration`` unless it already names a newer one; atomic (write, rename), and on disk
    unless not ``durable`` (see :func:`.atomic.atomic_file`)."""
    current = tracker_iteration(save_dir)
    if current is None or current < iteration:
        with atomic_file(os.path.join(save_dir, TRACKER), sync_directory=True, durable=durable) as handle:
            handle.write(str(iteration))
