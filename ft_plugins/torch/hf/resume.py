"""``resume`` for the Trainer: the newest *intact* ``checkpoint-N`` is resumed, every save is committed,
and rotation never deletes the last good checkpoint.

- ``get_last_checkpoint`` (transformers' own and every copy imported by name: ``transformers.trainer``'s, which
  ``resume_from_checkpoint=True`` calls, LLaMA-Factory's) returns the newest intact checkpoint, skipping each
  damaged one with its reason; decided once by rank 0 and the same on every rank (:mod:`.agree`). Checkpoints
  present, none intact: NoIntactCheckpoint. ``resume_from_checkpoint=True`` goes through it.
- ``Trainer.train(resume_from_checkpoint=PATH)``: PATH is used only when intact.
- ``_save_checkpoint``: rotation is held back until every rank has written its part (rank 0's files,
  each rank's ``rng_state_*``: a barrier), then rank 0 writes the manifest and rotates; rotation keeps
  the newest committed checkpoint and deletes nothing while a newer save is uncommitted.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ft_plugins.checkpoint.errors import NoIntactCheckpoint
from ft_plugins.features import resume as resume_feature
from ft_plugins.patching import Patch
from ft_plugins.torch.hf.agree import agree, barrier
from ft_plugins.torch.hf.rotation import Rotation
from ft_plugins.torch.hf.targets import TRAINER, TRAINER_UTILS

log = logging.getLogger("ft_plugins.resume")

INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers v5's just-in-time save


class Chooser:
    """The newest intact checkpoint of a directory, agreed on by every rank; shared by Trainer and Accelerate."""

    def __init__(self, feature: resume_feature.Resume) -> None:
        self.feature = feature
        self.saves = 0  # saves finished by this process: a later question about the same directory is a new one
        self._decided: dict[str, dict[str, Any]] = {}

    def _agree(self, topic: str, decide: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Each question decided once per process (a script and ``Trainer.train`` both ask) and per save."""
        key = f"{topic}/{self.saves}"
        if key not in self._decided:
            self._decided[key] = agree(key, decide)
        return self._decided[key]

    def newest_intact(self, directory: str) -> str | None:
        """The path, or None when the directory holds no checkpoint; raises NoIntactCheckpoint."""
        def decide() -> dict[str, Any]:
            try:
                return {"path": self.feature.choose(directory, "hf").path}
            except NoIntactCheckpoint as exc:
                return {"error": str(exc), "skipped": [list(pair) for pair in exc.skipped]}

        return _outcome(self._agree(f"latest/{os.path.abspath(directory)}", decide))

    def intact(self, path: str) -> str:
        """``path`` when it is an intact checkpoint; NoIntactCheckpoint naming what is wrong otherwise."""
        from ft_plugins.checkpoint import CheckpointError, verify

        def decide() -> dict[str, Any]:
            try:
                verdict = verify(path)
            except CheckpointError as exc:
                log.info("resume: %s cannot be judged (%s); loaded as given", path, exc)
                return {"path": path}
            if verdict.intact:
                return {"path": path}
            message = (f"resume_from_checkpoint={path} is not intact: {'; '.join(verdict.reasons)}; give an intact "
                       "checkpoint, or resume_from_checkpoint=True for the newest intact one")
            log.error("resume: %s", message)
            return {"error": message, "skipped": []}

        return str(_outcome(self._agree(f"path/{os.path.abspath(path)}", decide)))


def _outcome(decision: dict[str, Any]) -> str | None:
    """The agreed path; NoIntactCheckpoint (with what was skipped, on every rank) for an agreed refusal."""
    if "error" in decision:
        skipped = [tuple(pair) for pair in decision["skipped"]]
        named = "; ".join(f"{path}: {reason}" for path, reason in skipped)
        raise NoIntactCheckpoint(decision["error"] + (f" (skipped: {named})" if named else ""), skipped)
    return decision["path"]


class TrainerResume:
    """The wrappers (wrapt signature) of transformers' ``get_last_checkpoint`` and Trainer methods."""

    def __init__(self, feature: resume_feature.Resume) -> None:
        self.feature = feature
        self.chooser = Chooser(feature)
        self.rotation = Rotation(feature)

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINER_UTILS, "get_last_checkpoint", self.get_last_checkpoint),
                Patch(TRAINER, "Trainer.train", self.train),
                Patch(TRAINER, "Trainer._save_checkpoint", self.save_checkpoint),
                *self.rotation.patches())

    def get_last_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        folder = kwargs.get("folder", args[0] if args else None)
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            return wrapped(*args, **kwargs)
        return self.chooser.newest_intact(os.fspath(folder))

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        given = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if isinstance(given, (str, os.PathLike)) and os.path.isdir(given):
            self.chooser.intact(os.fspath(given))
        return wrapped(*args, **kwargs)

    def save_checkpoint(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        trial = kwargs.get("trial", args[1] if len(args) > 1 else None)
        run_dir = trainer._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"checkpoint-{trainer.state.global_step}")
        if trainer.args.should_save:
            _clear_stale_records(checkpoint)
        self.rotation.held = True
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self.rotation.held = False
        barrier()
        self.chooser.saves += 1
        if trainer.args.should_save:
            self.feature.commit(checkpoint)
            self.rotation.after_commit(trainer, run_dir)
        return result


def _clear_stale_records(checkpoint: str) -> None:
    """Before a save into an existing (damaged, skipped) ``checkpoint-N``: its old manifest and v5 marker
    go, so they describe nothing of the new save."""
    from ft_plugins.checkpoint.manifest import MANIFEST

    for name in (MANIFEST, INCOMPLETE_MARKER):
        try:
            os.unlink(os.path.join(checkpoint, name))
        except FileNotFoundError:
            pass
