"""``resume`` on MindSpore: load the newest intact checkpoint at train begin, commit every save."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

from mindspore.train import Callback, RunContext

from ft_plugins.checkpoint import CheckpointError, find_latest
from ft_plugins.checkpoint.layouts.mindspore import iteration_dir, rank_file_manifest
from ft_plugins.checkpoint.naming import tracker_iteration
from ft_plugins.features.resume import Resume, check_time
from ft_plugins.mindspore.base import checkpoint_callback, global_rank, runtime_for, save_root
from ft_plugins.mindspore.mindformers import TrainerRun, trainer_run
from ft_plugins.runtime import Runtime

log = logging.getLogger("ft_plugins.mindspore")


ASYNC_WRITER = "asyn_save_ckpt"  # MindSpore's name for its asynchronous checkpoint writer, thread or process


def _async_writer_running() -> bool:
    import multiprocessing
    import threading

    return any(thread.name == ASYNC_WRITER for thread in threading.enumerate()) or \
        any(process.name == ASYNC_WRITER for process in multiprocessing.active_children())


def _iteration_root(checkpoint: Any) -> str:
    """Where MindFormers' CheckpointMonitor puts ``iteration_*`` folders (its ``save_checkpoint``'s rule)."""
    if checkpoint.directory:
        return os.path.realpath(checkpoint.directory)
    from mindformers.tools.utils import get_output_subpath

    return get_output_subpath("checkpoint", append_rank=False)


class SaveCommitter:
    """Commits every save of one ``ModelCheckpoint`` once its file is written, whatever the callback order.

    ModelCheckpoint (and MindFormers' CheckpointMonitor) saves inside its own step end and train end;
    callbacks run in list order, so a callback placed before it would see a save only one step late and
    the last one never. The committer therefore wraps those two methods on that one instance (never the
    class), writes this rank's manifest beside each new file (:meth:`Resume.commit`), and unwraps itself
    after the train end. With ``async_save`` a file is written after its save returned: it is committed
    once MindSpore's writer finished it (MindSpore finishes the previous file before starting the next,
    and every file at the train end), so a crash before that leaves it uncommitted. MindFormers' newer
    ``iteration_*`` layout is committed once MindFormers finalized the save (its tracker names it).
    """

    EVENTS = ("on_train_step_end", "on_train_end")
    _ATTRIBUTE = "_ft_plugins_committer"

    def __init__(self, checkpoint: Any, resume: Resume) -> None:
        self.checkpoint = checkpoint
        self.resume = resume
        self.last_seen = checkpoint.latest_ckpt_file_name
        self.writing: list[str] = []  # saved, possibly still being written (async_save)
        self.committed_iteration: int | None = None  # MindFormers' iteration_* layout
        self.refused: str | None = None  # why this run's saves cannot be committed, said once
        for event in self.EVENTS:
            setattr(checkpoint, event, self._then_commit(getattr(checkpoint, event), event == "on_train_end"))
        setattr(checkpoint, self._ATTRIBUTE, self)

    @classmethod
    def attach(cls, checkpoint: Any, resume: Resume) -> SaveCommitter:
        """The committer of ``checkpoint``: the one already attached (by another callback or an interrupted
        run), else a new one."""
        existing = vars(checkpoint).get(cls._ATTRIBUTE)
        return existing if isinstance(existing, cls) else cls(checkpoint, resume)

    def detach(self) -> None:
        for attribute in (*self.EVENTS, self._ATTRIBUTE):
            vars(self.checkpoint).pop(attribute, None)

    def _then_commit(self, event: Any, last: bool) -> Any:
        @functools.wraps(event)
        def then_commit(run_context: RunContext) -> None:
            event(run_context)
            self.commit_new_save()
            if last:
                self.detach()

        return then_commit

    def commit_new_save(self) -> None:
        if getattr(self.checkpoint, "use_legacy_format", True) is False:
            self._commit_finalized_iteration()
            return
        latest = self.checkpoint.latest_ckpt_file_name
        if latest and latest != self.last_seen:
            self.last_seen = latest
            if rank_file_manifest(latest) is None:
                self._refuse(f"{os.path.basename(latest)} is not a per-rank <prefix>-<epoch>_<step>.ckpt file: "
                             "not committed")
            else:
                self.writing.append(latest)
        written = self.writing[:-1] if self.writing and _async_writer_running() else self.writing
        for path in written:
            self._commit(path)
        self.writing = self.writing[len(written):]

    def _commit_finalized_iteration(self) -> None:
        """MindFormers' ``iteration_{:08d}/`` layout: rank 0 writes the tracker once every rank's files are
        saved (after the save's barrier, or in the asynchronous save's finalize); rank 0 commits what it names."""
        if global_rank() not in (0, None):
            return
        root = _iteration_root(self.checkpoint)
        iteration = tracker_iteration(root)
        if iteration is not None and iteration != self.committed_iteration:  # None: nothing finalized yet
            self.committed_iteration = iteration
            self._commit(iteration_dir(root, iteration))

    def _commit(self, path: str) -> None:
        if not os.path.exists(path):
            self._refuse(f"{os.path.basename(path)} is absent after its save finished: not committed")
            return
        try:
            self.resume.commit(path)
        except Exception as exc:  # never into training
            log.warning("resume: commit of %s failed: %s: %s", path, type(exc).__name__, exc)

    def _refuse(self, refusal: str) -> None:
        if refusal != self.refused:
            log.info("resume: %s; resume checks these checkpoints' structure only", refusal)
            self.refused = refusal


NO_DIRECTORY = ("resume: initial_epoch() cannot know where the checkpoints are: Model.train takes its initial_epoch "
                "before any callback sees the run's ModelCheckpoint. Pass the directory it saves into (the parent "
                "of the rank_N directories) as FaultTolerance(resume_dir=DIR) (or ResumeCallback(DIR))")
HOW = "initial_epoch=ft.initial_epoch(steps_per_epoch, dataset) in Model.train, ft = FaultTolerance(resume_dir=DIR)"


class ResumeCallback(Callback):
    """Loads the newest intact checkpoint of ``directory`` for this rank at train begin, and commits
    every save of the run's ``ModelCheckpoint`` (:class:`SaveCommitter`).

    The choice is made at construction, on every rank, so that ``initial_epoch(steps_per_epoch, dataset)`` can
    tell ``Model.train`` where to start and the dataset what to skip: under a distributed launch each rank checks
    only its own files and the ranks agree on the newest checkpoint intact on all of them (an all-gather a round);
    broken, truncated, uncommitted and ``_breakpoint`` checkpoints are skipped with the reason. Without
    ``directory`` nothing can be chosen before training: ``initial_epoch`` refuses, and a train begin that finds a
    checkpoint in the run's ``ModelCheckpoint`` directory stops with the fix, rather than train every epoch again on
    top of it.
    Inside MindFormers' trainer it never loads: MindFormers resumes itself (``resume_training``, guarded by
    :mod:`ft_plugins.mindspore.mindformers`) and counts steps and data from there; this only commits.
    """

    def __init__(self, directory: str = "", format: str = "auto", runtime: Runtime | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.resume = runtime_for("resume", runtime, options).running(Resume)
        self.format = format
        self.directory = directory
        self.selection = None
        self.committer: SaveCommitter | None = None
        self.start_step: int | None = None  # MindSpore's step counter at train begin, once initial_epoch decided
        self.start_epoch: int | None = None  # what initial_epoch told Model.train
        self.plan: tuple[int, Any] | None = None  # (steps_per_epoch, dataset) given to initial_epoch
        self.first_step = False
        if self.resume is not None and directory and trainer_run() is None:
            self._choose(save_root(directory))

    def _choose(self, directory: str, every_rank: bool = True) -> None:
        """The resume choice; only NoIntactCheckpoint (checkpoints exist, none intact) stops the job, before
        training. A directory that cannot be examined is logged and training starts as MindSpore would.
        ``every_rank``: every rank makes this call, so each checks only its own files and the ranks agree on the
        newest intact on all (:mod:`ft_plugins.checkpoint.agreed`), the same step on every rank by construction."""
        from ft_plugins.checkpoint.errors import NoIntactCheckpoint
        from ft_plugins.mindspore.agree import all_gather

        gather = all_gather() if every_rank else None
        if gather is None and not os.path.isdir(directory):
            log.info("resume: %s does not exist yet; starting from scratch", directory)
            return
        try:
            self.selection = self.resume.choose(directory, self.format, rank=global_rank(), gather=gather)
        except NoIntactCheckpoint:
            raise
        except Exception as exc:  # never into training
            log.warning("resume: cannot examine %s (%s: %s); nothing resumed", directory, type(exc).__name__, exc)

    def initial_epoch(self, steps_per_epoch: int, dataset: Any = None) -> int:
        """``Model.train``'s ``initial_epoch``: the chosen checkpoint's epoch if it ended it, else the one before.

        ``Model.train`` cannot start inside an epoch: for a mid-epoch checkpoint the training ``dataset``
        skips the steps done (``set_init_step``) so training continues at the exact step. ValueError when
        no directory was given, or a mid-epoch checkpoint comes without the dataset (its first steps would
        be trained twice).
        """
        if self.resume is None:
            return 0
        if not self.directory:
            raise ValueError(NO_DIRECTORY)
        self.plan = (steps_per_epoch, dataset)
        self.start_epoch = self.start_step = 0
        if self.selection is None or self.selection.path is None or self.selection.epoch is None:
            return 0
        epoch, step = self.selection.epoch, self.selection.step or 0
        if step >= steps_per_epoch:
            self.start_epoch = epoch
        elif dataset is None:
            raise ValueError(f"resume: {self.selection.path} is {step} steps into epoch {epoch}; pass the training "
                             "dataset, ft.initial_epoch(steps_per_epoch, dataset), so that it skips them (Model.train "
                             "starts at an epoch's beginning and would train them a second time)")
        else:
            self.start_epoch = epoch - 1
            dataset.set_init_step(step)
            log.info("resume: %s is %d steps into epoch %d; the dataset skips them", self.selection.path, step, epoch)
        self.start_step = self.start_epoch * steps_per_epoch + (step if self.start_epoch < epoch else 0)
        return self.start_epoch

    def on_train_begin(self, run_context: RunContext) -> None:
        if self.resume is None:
            return
        cb_params = run_context.original_args()
        checkpoint = checkpoint_callback(cb_params)
        run = trainer_run(consume=True)
        if run is not None:  # MindFormers' trainer: it resumes (ft_plugins chose the file); saves still committed
            if checkpoint is not None:
                self.committer = SaveCommitter.attach(checkpoint, self.resume)
            self._leave_to_mindformers(run, checkpoint)
            return
        if checkpoint is not None:
            if self.selection is None and not self.directory:  # only to refuse a silent retrain (maybe one rank)
                self._choose(save_root(checkpoint._directory), every_rank=False)  # noqa: SLF001
            self.committer = SaveCommitter.attach(checkpoint, self.resume)
        if self.selection is None or self.selection.path is None:
            return
        self._check_plan(cb_params)
        from mindspore import load_checkpoint, load_param_into_net

        load_param_into_net(cb_params.train_network, load_checkpoint(self.selection.path))
        cb_params.cur_step_num = self.start_step
        if checkpoint is not None:  # its save cadence counts on from the checkpoint's step, as in one long run
            checkpoint._last_triggered_step = self.start_step  # noqa: SLF001
        self.first_step = True
        log.info("resume: loaded %s (epoch %s, step %s); training continues at step %d", self.selection.path,
                 self.selection.epoch, self.selection.step, self.start_step + 1)

    def _check_plan(self, cb_params: Any) -> None:
        """Stop before the first step when Model.train was not told where the checkpoint continues."""
        found = f"{self.selection.path} (epoch {self.selection.epoch}, step {self.selection.step})"
        if not self.directory:
            raise RuntimeError(f"resume: found {found}, but FaultTolerance() was given no resume_dir, so Model.train "
                               f"starts at epoch 1 and would train every step again on top of it; resume with {HOW}, "
                               "or leave resume out of the features to start from scratch")
        if self.plan is None:
            raise RuntimeError(f"resume: found {found}, but initial_epoch was not asked, so Model.train would train "
                               f"every step again on top of it; pass {HOW}")
        steps_per_epoch, dataset = self.plan
        if steps_per_epoch != cb_params.batch_num:
            raise RuntimeError(f"resume: initial_epoch counted {steps_per_epoch} steps per epoch to continue {found}, "
                               f"the dataset has {cb_params.batch_num}: {HOW.replace('steps_per_epoch', 'dataset.get_dataset_size()')}")
        if dataset is not None and self.start_epoch < self.selection.epoch and cb_params.train_dataset is not dataset:
            raise RuntimeError(f"resume: initial_epoch skipped the steps of {found} in another dataset than the one "
                               f"Model.train trains on; give both the same dataset object: {HOW}")

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self.first_step:
            self.first_step = False
            epoch = run_context.original_args().cur_epoch_num
            if epoch != self.start_epoch + 1:
                raise RuntimeError(f"resume: Model.train starts at epoch {epoch}, but {self.selection.path} continues "
                                   f"in epoch {self.start_epoch + 1}: pass {HOW}")

    def __exit__(self, *exc_info: object) -> None:
        """Model.train leaves its callbacks' context even when training raised: the wrappers come off then too."""
        if self.committer is not None:
            self.committer.detach()
            self.committer = None

    def _leave_to_mindformers(self, run: TrainerRun, checkpoint: Any) -> None:
        """Say who resumed, or how to resume: loading here would leave MindFormers' step and data counts at 0."""
        if run.resuming:
            log.info("resume: MindFormers resumed from %s at step %d; ft_plugins chose that checkpoint and only "
                     "commits saves", run.checkpoint, run.initial_step)
            return
        directory = self.directory or (save_root(checkpoint._directory) if checkpoint is not None else "")  # noqa: SLF001
        if not directory or not os.path.isdir(directory):
            return
        started = time.monotonic()
        try:
            found = find_latest(directory, self.format, rank=global_rank())
        except CheckpointError:
            return
        if found.path or found.skipped:
            log.warning("resume: %s holds checkpoints (%s), but MindFormers starts this run at step 0 "
                        "(resume_training is off) and ft_plugins does not load behind its back; to resume, set "
                        "resume_training: True and load_checkpoint: %s (ft_plugins then picks the newest intact "
                        "checkpoint)", directory, check_time(started), directory)
