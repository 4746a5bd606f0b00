"""Rotation (``save_total_limit``) under ``resume``: held back until a save is committed, nothing deleted while a
newer save is uncommitted, and the newest intact checkpoint never deleted.

transformers 4.x and 5.0 rotate in ``Trainer._rotate_checkpoints`` over ``Trainer._sorted_checkpoints``; later 5.x
releases in ``trainer_utils.rotate_checkpoints`` over ``trainer_utils.sort_checkpoints`` (the trainer calls the
copy it imported by name, which the patch reaches too). Which of the two is used is found by what the installed
transformers has, not by its version number.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

from ft_plugins.features import resume as resume_feature
from ft_plugins.patching import Patch
from ft_plugins.torch.hf.targets import TRAINER, TRAINER_UTILS

log = logging.getLogger("ft_plugins.resume")

STEP = re.compile(r"checkpoint[-_](\d+)$")


def committed(path: str) -> bool:
    """Whether the save at ``path`` has its commit manifest (the checkpoint package loads on first use)."""
    from ft_plugins.checkpoint.manifest import MANIFEST

    return os.path.exists(os.path.join(path, MANIFEST))


def number(path: str) -> int:
    """The step of a ``checkpoint-N`` path; -1 for another name."""
    match = STEP.search(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else -1


def rotates_in_function() -> bool:
    """Whether the installed transformers rotates with ``trainer_utils.rotate_checkpoints`` (5.x after 5.0)."""
    try:
        from transformers import trainer_utils
    except ImportError:  # accelerate without transformers: the Trainer's patches never apply
        return False
    return callable(getattr(trainer_utils, "rotate_checkpoints", None))


class Rotation:
    """The rotation's wrappers (wrapt signature) for either layout; ``held`` while a save is being written."""

    def __init__(self, feature: resume_feature.Resume) -> None:
        self.feature = feature
        self.held = False
        self.in_function = rotates_in_function()
        self._keep: str | None = None  # inside one rotation: the newest intact checkpoint, sorted last

    def patches(self) -> tuple[Patch, ...]:
        if self.in_function:
            return (Patch(TRAINER_UTILS, "rotate_checkpoints", self.rotate_function),
                    Patch(TRAINER_UTILS, "sort_checkpoints", self.sort))
        return (Patch(TRAINER, "Trainer._rotate_checkpoints", self.rotate_method),
                Patch(TRAINER, "Trainer._sorted_checkpoints", self.sort))

    def after_commit(self, trainer: Any, run_dir: str) -> None:
        """The rotation transformers' save would have made, now that the save is committed."""
        if not self.in_function:
            trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
            return
        from transformers import trainer_utils

        trainer_utils.rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                                         best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)

    def rotate_method(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        """``Trainer._rotate_checkpoints(use_mtime=False, output_dir=None)``."""
        output_dir = kwargs.get("output_dir", args[1] if len(args) > 1 else None) or trainer.args.output_dir
        return self._rotate(lambda: wrapped(*args, **kwargs), output_dir)

    def rotate_function(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``trainer_utils.rotate_checkpoints(output_dir, save_total_limit=None, ...)``."""
        return self._rotate(lambda: wrapped(*args, **kwargs), kwargs.get("output_dir", args[0] if args else None))

    def sort(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Either sort: the checkpoint kept by the rotation under way sorts last, where the newest is never deleted."""
        found = wrapped(*args, **kwargs)
        if self._keep is None:
            return found
        keep = [path for path in found if os.path.normpath(path) == self._keep]
        return [path for path in found if os.path.normpath(path) != self._keep] + keep

    def _rotate(self, rotate: Callable[[], Any], output_dir: str | os.PathLike[str] | None) -> Any:
        if self.held:
            return None  # held back until every rank finished and the save is committed
        if not self.feature.settings["manifest"] or output_dir is None:
            return rotate()
        from ft_plugins.checkpoint import find_latest

        output_dir = os.fspath(output_dir)
        newest = find_latest(output_dir, "hf").path
        blocking = uncommitted(checkpoints(output_dir), newest)
        if blocking:
            log.warning("resume: no checkpoint rotated: %s is not committed%s", blocking,
                        f" (newest intact: {newest})" if newest else "")
            return None
        self._keep = os.path.normpath(newest) if newest else None
        try:
            return rotate()
        finally:
            self._keep = None


def checkpoints(directory: str) -> list[str]:
    """Every ``checkpoint-N`` (the Trainer's) or ``checkpoint_N`` (Accelerate's) folder of ``directory``, oldest
    first."""
    try:
        with os.scandir(directory) as entries:
            found = [entry.path for entry in entries if STEP.search(entry.name) and entry.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(found, key=number)


def uncommitted(folders: list[str], newest: str | None) -> str | None:
    """The newest of ``folders`` (oldest first) that is newer than ``newest``, the newest committed checkpoint, and
    not committed itself: while there is one, nothing is rotated, and ``newest`` is never deleted."""
    floor = number(newest) if newest else -1
    waiting = [path for path in folders if number(path) > floor and not committed(path)]
    return waiting[-1] if waiting else None
