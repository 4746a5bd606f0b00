"""Megatron glue for ``resume``: ``load_checkpoint`` loads the newest intact iteration, saves get committed.

Megatron trusts ``latest_checkpointed_iteration.txt``: a garbage tracker exits, one naming a broken
iteration fails the load. Around ``load_checkpoint`` rank 0 chooses the newest intact iteration,
broadcasts it, and every rank loads that one (Megatron's own ``ckpt_step``, and its tracker reader
answering with the choice for the length of the call). After ``save_checkpoint`` returns (all
ranks have passed its barrier), rank 0 writes the commit manifest. An ``--async-save`` returns
before the files are written: its commit becomes the last finalize function of the save's request,
which Megatron runs on every rank once every rank's write is done (after its own metadata and
tracker), so a crash before finalization leaves the checkpoint uncommitted.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ft_plugins.features import resume as resume_feature
from ft_plugins.rank import global_rank

log = logging.getLogger("ft_plugins.resume")


def _rank() -> int:
    return global_rank() or 0


def _broadcast(decision: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's decision on every rank (a no-op without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class MegatronResume:
    """The two wrappers (wrapt signature) and :meth:`wrap_load` for source patched by ``ft-plugins patch``."""

    def __init__(self, feature: resume_feature.Resume) -> None:
        self.feature = feature

    def _decide(self, load_dir: str | None) -> dict[str, Any]:
        """Rank 0's choice: ``{"iteration", "release"}``, ``{"error"}``, or ``{}`` to leave Megatron alone."""
        if _rank() != 0 or not load_dir:
            return {}
        try:
            selection = self.feature.choose(load_dir, "megatron")
        except resume_feature.NoIntactCheckpoint as exc:
            return {"error": str(exc), "skipped": list(exc.skipped)}
        except Exception as exc:  # e.g. an unreadable directory: Megatron's own load reports it
            log.warning("resume: cannot examine %s (%s); Megatron loads as usual", load_dir, exc)
            return {}
        if selection.path is None:
            return {"iteration": None, "release": False}
        release = selection.iteration is None
        return {"iteration": 0 if release else selection.iteration, "release": release}

    @contextmanager
    def _loading(self, checkpointing: Any, megatron_args: Any, load_dir: str | None) -> Iterator[None]:
        """For one load: every rank uses rank 0's choice; Megatron's tracker reader and ckpt_step follow it."""
        if getattr(megatron_args, "ckpt_step", None):  # the user named the step: Megatron's own behaviour
            yield
            return
        decision = _broadcast(self._decide(load_dir))
        if "error" in decision:
            raise resume_feature.NoIntactCheckpoint(decision["error"], decision.get("skipped", ()))
        if "iteration" not in decision:
            yield
            return
        iteration, release = decision["iteration"], decision["release"]
        if _rank() != 0:
            self.feature.followed_iteration = iteration
        original_reader = checkpointing.read_metadata
        had_step = hasattr(megatron_args, "ckpt_step")  # Megatron-LM before core_r0.8 has no ckpt_step
        checkpointing.read_metadata = lambda tracker_filename: (-1 if iteration is None else iteration, release)
        if iteration and not release and had_step:
            megatron_args.ckpt_step = iteration
        try:
            yield
        finally:
            checkpointing.read_metadata = original_reader
            if had_step:
                megatron_args.ckpt_step = None

    def load_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        checkpointing = sys.modules[wrapped.__module__]
        megatron_args = checkpointing.get_args()
        load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
        with self._loading(checkpointing, megatron_args, getattr(megatron_args, load_arg, None)):
            return wrapped(*args, **kwargs)

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs.get("non_persistent_ckpt"):  # local / non-persistent saves live elsewhere
            return wrapped(*args, **kwargs)
        checkpointing = sys.modules[wrapped.__module__]
        commit = functools.partial(self._commit, checkpointing, kwargs.get("iteration", args[0] if args else None),
                                   kwargs.get("release", False))
        if getattr(checkpointing.get_args(), "async_save", False):
            with self._committing_when_finalized(checkpointing, commit):
                return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        commit()
        return result

    @contextmanager
    def _committing_when_finalized(self, checkpointing: Any, commit: Callable[[], None]) -> Iterator[None]:
        """For one save: the async request it schedules gets ``commit`` as its last finalize function."""
        schedule = getattr(checkpointing, "schedule_async_save", None)
        if schedule is None:
            log.warning("resume: this Megatron schedules async saves differently; they are not committed")
            yield
            return

        def schedule_committing(request: Any, *args: Any, **kwargs: Any) -> Any:
            if hasattr(request, "add_finalize_fn"):
                request.add_finalize_fn(commit)
            else:  # megatron-core before add_finalize_fn: a plain list
                request.finalize_fns.append(commit)
            return schedule(request, *args, **kwargs)

        checkpointing.schedule_async_save = schedule_committing
        try:
            yield
        finally:
            checkpointing.schedule_async_save = schedule

    def _commit(self, checkpointing: Any, iteration: int | None, release: bool) -> None:
        """Rank 0 writes the manifest once every rank finished the save, and has a large save checked in the
        background (its verdict is there for the next start); never raises into training."""
        try:
            megatron_args = checkpointing.get_args()
            if _rank() != 0 or iteration is None or not getattr(megatron_args, "save", None):
                return
            checkpoint = os.path.join(megatron_args.save, "release" if release else f"iter_{iteration:07d}")
            if self.feature.commit(checkpoint):
                from ft_plugins.checkpoint.judging import judge_later

                judge_later(checkpoint, self.feature.settings["deep"])
        except Exception as exc:  # never into training
            log.warning("resume: commit after save failed: %s: %s", type(exc).__name__, exc)

    def wrap_load(self, load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        """``load_checkpoint`` with the same signature, choosing the newest intact iteration."""

        @functools.wraps(load_checkpoint)
        def load_newest_intact(*args: Any, **kwargs: Any) -> Any:
            return self.load_checkpoint(load_checkpoint, None, args, kwargs)

        return load_newest_intact
