"""``resume`` for Accelerate's ``save_state`` / ``load_state``.

Stock Accelerate with ``automatic_checkpoint_naming`` deletes the oldest ``checkpoint_N`` *before* it
writes the new one, restarts its counter at 0 in a new process, and loads the highest-numbered folder
unchecked. Here: the counter continues from what is on disk, the new save is written whole (every
rank's ``random_states_*``: a barrier) and committed, and only then are old folders pruned (never the
newest committed one, nothing while a newer one is uncommitted); ``load_state()`` without a path
loads the newest intact folder, the same on every rank; an explicit path only when intact.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable

from ft_plugins.features.resume import Resume
from ft_plugins.patching import Patch
from ft_plugins.torch.hf.agree import barrier
from ft_plugins.torch.hf.resume import Chooser
from ft_plugins.torch.hf.rotation import checkpoints, committed, number, uncommitted
from ft_plugins.torch.hf.targets import ACCELERATOR

log = logging.getLogger("ft_plugins.resume")


class AcceleratorResume:
    def __init__(self, feature: Resume) -> None:
        self.feature = feature
        self.chooser = Chooser(feature)

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(ACCELERATOR, "Accelerator.save_state", self.save_state),
                Patch(ACCELERATOR, "Accelerator.load_state", self.load_state))

    def save_state(self, wrapped: Callable[..., Any], accelerator: Any, args: tuple, kwargs: dict) -> Any:
        project = accelerator.project_configuration
        if not project.automatic_checkpoint_naming:
            output_dir = kwargs.get("output_dir", args[0] if args else None)
            result = wrapped(*args, **kwargs)
            self._commit(accelerator, os.fspath(output_dir) if output_dir is not None else None)
            return result
        root = os.path.join(accelerator.project_dir, "checkpoints")
        on_disk = [number(path) for path in checkpoints(root)]
        if on_disk and project.iteration <= max(on_disk):
            if accelerator.is_main_process:
                log.info("resume: Accelerate's checkpoint counter continues at %d (checkpoint_%d is on disk)",
                         max(on_disk) + 1, max(on_disk))
            project.iteration = max(on_disk) + 1
        limit, project.total_limit = project.total_limit, None  # pruned below, once the new save is committed
        try:
            result = wrapped(*args, **kwargs)
        finally:
            project.total_limit = limit
        checkpoint = os.path.join(root, f"checkpoint_{project.iteration - 1}")
        self._commit(accelerator, checkpoint)
        if accelerator.is_main_process and limit:
            _prune(root, limit)
        return result

    def _commit(self, accelerator: Any, checkpoint: str | None) -> None:
        barrier()
        self.chooser.saves += 1
        if checkpoint is not None and accelerator.is_main_process:
            self.feature.commit(checkpoint)

    def load_state(self, wrapped: Callable[..., Any], accelerator: Any, args: tuple, kwargs: dict) -> Any:
        given = kwargs.get("input_dir", args[0] if args else None)
        if given is not None:
            if os.path.isdir(os.path.expanduser(given)):
                self.chooser.intact(os.path.expanduser(os.fspath(given)))
            return wrapped(*args, **kwargs)
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            return wrapped(*args, **kwargs)
        chosen = self.chooser.newest_intact(os.path.join(accelerator.project_dir, "checkpoints"))
        if chosen is None:
            return wrapped(*args, **kwargs)  # Accelerate's own error for an empty directory
        kwargs.pop("input_dir", None)
        return wrapped(chosen, *args[1:], **kwargs)


def _prune(root: str, limit: int) -> None:
    """Delete the oldest folders beyond ``limit``, never the newest committed one, nothing while a newer
    folder is uncommitted."""
    folders = checkpoints(root)
    good = [path for path in folders if committed(path)]
    blocking = uncommitted(folders, good[-1] if good else None)
    if blocking or not good:
        log.warning("resume: nothing pruned: %s is not committed", blocking or root)
        return
    for path in [path for path in folders if path != good[-1]][:max(0, len(folders) - limit)]:
        log.info("resume: deleting %s (total_limit=%d, after %s was committed)", path, limit, good[-1])
        shutil.rmtree(path, ignore_errors=True)
