"""MindSpore ``Callback``s: thin event adapters over the framework-neutral features.

``FaultTolerance`` is the one entry (plain ``Model.train`` or a MindFormers YAML ``callbacks:``
item); it is made of the single-feature callbacks below, which can also be used alone. Every
check that can refuse a feature runs before the first step: in strict mode it stops training
there, otherwise the feature is switched off with one warning and training proceeds.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import mindspore
from mindspore.train import Callback, RunContext

from ft_plugins.checkpoint.layouts import rank_file_manifest
from ft_plugins.config import STRICT_VAR
from ft_plugins.features.mstx import Mstx
from ft_plugins.features.resume import Resume
from ft_plugins.features.taskd import Taskd
from ft_plugins.features.ttp import Ttp
from ft_plugins.runtime import Runtime, activate

log = logging.getLogger("ft_plugins.mindspore")

FRAMEWORK = "ms"


def global_rank() -> int | None:
    """This process's global rank: from MindSpore once communication is up, else msrun's variables."""
    from mindspore.communication.management import GlobalComm, get_rank

    if GlobalComm.INITED:
        return get_rank()
    for var in ("RANK_ID", "MS_NODE_ID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0 if os.environ.get("MS_WORKER_NUM", "1") in ("", "1") else None


def _runtime_for(feature: str, runtime: Runtime | None, options: Mapping[str, Any]) -> Runtime:
    """The given runtime, or one activated for this feature alone (a single-feature callback used by itself)."""
    if runtime is not None:
        return runtime
    return activate(FRAMEWORK, features=feature, options={feature: dict(options)} if options else None)


def _checkpoint_callback(cb_params: Any) -> Any:
    """The run's ``ModelCheckpoint`` (MindFormers' ``CheckpointMonitor`` is one): where checkpoints go."""
    from mindspore.train.callback import ModelCheckpoint

    return next((cb for cb in cb_params.list_callback if isinstance(cb, ModelCheckpoint)), None)


def _save_root(directory: str) -> str:
    """The save directory holding every rank's checkpoints: MindFormers' CheckpointMonitor writes into ``rank_N``."""
    path = os.path.normpath(directory)
    return os.path.dirname(path) if re.fullmatch(r"rank_\d+", os.path.basename(path)) else path


_worker_owner: Taskd | None = None  # the feature that started this process's TaskD worker


class TaskdWorkerCallback(Callback):
    """Starts TaskD's worker at train begin (after communication init), with the global rank and "ms".

    Once per process, however many callbacks or ``Model.train`` calls the script makes.
    """

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        super().__init__()
        self.taskd = _runtime_for("taskd", runtime, options).running(Taskd)

    def on_train_begin(self, run_context: RunContext) -> None:
        global _worker_owner
        if self.taskd is None or _worker_owner is not None:
            return
        _worker_owner = self.taskd
        try:
            self.taskd.start_worker(global_rank())
        except Exception as exc:  # never into training
            log.warning("taskd: worker start failed: %s: %s", type(exc).__name__, exc)


class StepRangesCallback(Callback):
    """``step {n}`` on the current device stream around every training step (n = MindSpore's global step).

    MindSpore offers no moment around a batch fetch in ``Model.train``, so no ``dataloader`` range;
    ``mindspore.save_checkpoint`` already emits ``save_checkpoint`` itself. When MindFormers' own
    monitor emits step ranges (``LD_PRELOAD`` holds libmspti), this adds none.
    """

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        super().__init__()
        self.mstx = _runtime_for("mstx", runtime, options).running(Mstx)
        self._handle: Any = None

    def on_train_begin(self, run_context: RunContext) -> None:
        if self.mstx is None:
            return
        emitter = next((cb for cb in run_context.original_args().list_callback
                        if cb is not self and getattr(cb, "mstx_enabled", False) and hasattr(cb, "mstx_range_id")),
                       None)
        if emitter is not None:
            log.info("mstx: %s already emits 'step {n}' ranges (libmspti in LD_PRELOAD); ft_plugins adds none",
                     type(emitter).__name__)
            self.mstx = None

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self.mstx is not None:
            self._handle = self.mstx.begin_step(run_context.original_args().cur_step_num)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.mstx is not None:
            self.mstx.end(self._handle)
            self._handle = None


def replica_problem(cb_params: Any) -> str | None:
    """Why no healthy rank would hold a copy of a failed rank's state, or None when one does.

    TTP saves a dead rank's parameters and optimizer state from a data-parallel replica: data
    parallel must be > 1, and a parallel optimizer must shard over fewer ranks than data parallel.
    """
    from mindspore import context
    from mindspore.communication.management import get_group_size

    mode = context.get_auto_parallel_context("parallel_mode")
    if mode == "stand_alone":
        data_parallel = 1
    elif mode == "data_parallel":
        data_parallel = get_group_size()
    else:
        from mindspore.train.serialization import _get_cur_rank_dp  # what TrainFaultTolerance reports

        layout = cb_params.train_network.parameter_layout_dict
        if not layout:  # graph not compiled yet: MindSpore checks the replica itself at the first step
            log.info("ttp: the %s layout is known only after the first step; data-parallel replica not checked", mode)
            return None
        data_parallel = len(_get_cur_rank_dp(layout))
    if data_parallel <= 1:
        return (f"data parallel is {data_parallel} ({mode}): no other rank holds a copy of this rank's state, "
                "so a dying-gasp save cannot replace a failed rank; run with data parallel > 1")
    if context.get_auto_parallel_context("enable_parallel_optimizer"):
        shard = context.get_auto_parallel_context("optimizer_weight_shard_size")
        if shard <= 0 or shard >= data_parallel:
            return (f"the parallel optimizer shards optimizer state over all {data_parallel} data-parallel ranks "
                    f"(optimizer_weight_shard_size={shard}), so no replica of it exists; set "
                    f"optimizer_weight_shard_size to a divisor of {data_parallel} below it, e.g. {data_parallel // 2}")
    return None


class TtpCallback(Callback):
    """Drives MindSpore's own ``TrainFaultTolerance`` (MindIO TTP) after checking what it needs.

    Checked before the first step: MindSpore 2.5+, no ``TrainFaultTolerance`` already in the run
    (MindFormers 1.5+ injects one when ``MS_ENABLE_TFT`` is set), ``sink_size`` <= 1, a data-parallel
    replica, an optimizer wrapped for TFT. The dying-gasp checkpoint is written where, and named as,
    the run's regular checkpoints, so that resume finds it.
    """

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        super().__init__()
        self.runtime = _runtime_for("ttp", runtime, options)
        self.ttp = self.runtime.running(Ttp)
        self.delegate: Any = None
        if self.ttp is not None and not hasattr(mindspore.train, "TrainFaultTolerance"):
            self._off(f"MindSpore {mindspore.__version__} has no TrainFaultTolerance; TTP needs MindSpore 2.5 or newer")

    def _off(self, reason: str) -> None:
        self.ttp = None
        self.runtime.disable("ttp", reason)  # raises FeatureUnavailable in strict mode

    def _problem(self, cb_params: Any) -> str | None:
        sink_size = cb_params.get("sink_size", -1)  # a dict: Model sets these only in sink mode
        if cb_params.get("dataset_sink_mode", False) and sink_size > 1:
            return (f"sink_size={sink_size}: MindIO can only save a consistent state between steps when every "
                    "step returns to the host; train with sink_size=1 or dataset_sink_mode=False")
        optimizer = cb_params.optimizer or getattr(cb_params.network, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "tft_g_one_flag"):
            return ("the optimizer is not wrapped for TFT, so MindIO cannot tell a finished update from a half one; "
                    "build it as TrainFaultTolerance.get_optimizer_wrapper(OptimizerClass)(...) or wrap it in "
                    "mindspore.nn.OptTFTWrapper (MindFormers 1.5+ does this itself when MS_ENABLE_TFT is set)")
        return replica_problem(cb_params)

    def on_train_begin(self, run_context: RunContext) -> None:
        if self.ttp is None:
            return
        from mindspore.train.callback import TrainFaultTolerance

        cb_params = run_context.original_args()
        existing = next((cb for cb in cb_params.list_callback if isinstance(cb, TrainFaultTolerance)), None)
        if existing is not None:
            log.info("ttp: the run already has %s (MindFormers adds it when MS_ENABLE_TFT is set); "
                     "ft_plugins does not add a second", type(existing).__name__)
            self.ttp = None
            return
        problem = self._problem(cb_params)
        if problem is not None:
            self._off(problem)
            return
        try:
            self.delegate = TrainFaultTolerance(ckpt_save_fn=self._save, initial_step=cb_params.cur_step_num)
        except Exception as exc:  # MindSpore refuses (e.g. not on Ascend); never into training
            self._off(f"MindSpore's TrainFaultTolerance refused to start: {type(exc).__name__}: {exc}")
            return
        log.info("ttp: MindIO TTP handlers registered through MindSpore's TrainFaultTolerance")
        self.delegate.on_train_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self.delegate is not None:
            self.delegate.on_train_step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.delegate is not None:
            self.delegate.on_train_step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        if self.delegate is not None:
            self.delegate.on_train_end(run_context)
            self.delegate = None

    def _save(self, cb_params: Any, append_dict: dict[str, Any]) -> None:
        """MindIO's save handler (in its own thread): this rank's state as the run's next regular checkpoint."""
        from mindspore import save_checkpoint

        checkpoint = _checkpoint_callback(cb_params)
        directory = self.ttp.settings["save_dir"] if self.ttp is not None else ""
        directory = directory or (checkpoint._directory if checkpoint is not None else "")  # noqa: SLF001
        if not directory:
            raise RuntimeError("ttp: nowhere to save: no ModelCheckpoint in the run and FT_PLUGINS_TTP_SAVE_DIR unset")
        prefix = checkpoint._prefix if checkpoint is not None else "ttp"  # noqa: SLF001
        step_in_epoch = (cb_params.cur_step_num - 1) % cb_params.batch_num + 1
        name = f"{prefix}-{cb_params.cur_epoch_num}_{step_in_epoch}.ckpt"
        append_dict.update(epoch_num=cb_params.cur_epoch_num, step_num=cb_params.cur_step_num)
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, name)
        staging = tempfile.mkdtemp(prefix=".ft_ttp-", dir=directory)  # resume never sees half a file
        try:
            partial = os.path.join(staging, name)
            save_checkpoint(cb_params.train_network, partial, integrated_save=False, append_dict=append_dict)
            os.replace(partial, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if self.ttp is not None:
            self.ttp.saves.append(target)
        log.warning("ttp: dying-gasp checkpoint written: %s", target)
        resume = self.runtime.running(Resume)
        if resume is not None:  # a whole file of this rank, as a regular save: committed like one
            resume.commit(target)


class SaveCommitter:
    """Commits every save of one ``ModelCheckpoint`` the moment the save returned, whatever the callback order.

    ModelCheckpoint (and MindFormers' CheckpointMonitor) saves inside its own step end and train end,
    synchronously unless ``async_save`` is set; callbacks run in list order, so a callback placed before
    it would see a save only one step late and the last one never. The committer therefore wraps those
    two methods on that one instance (never the class), writes this rank's manifest beside each new
    file (:meth:`Resume.commit`), and unwraps itself after the train end.
    """

    EVENTS = ("on_train_step_end", "on_train_end")
    _ATTRIBUTE = "_ft_plugins_committer"

    def __init__(self, checkpoint: Any, resume: Resume) -> None:
        self.checkpoint = checkpoint
        self.resume = resume
        self.last_seen = checkpoint.latest_ckpt_file_name
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
        latest = self.checkpoint.latest_ckpt_file_name
        if not latest or latest == self.last_seen:
            return
        self.last_seen = latest
        refusal = self._refusal(latest)
        if refusal is not None:
            if refusal != self.refused:
                log.info("resume: %s; resume checks these checkpoints' structure only", refusal)
                self.refused = refusal
            return
        try:
            self.resume.commit(latest)
        except Exception as exc:  # never into training
            log.warning("resume: commit of %s failed: %s: %s", latest, type(exc).__name__, exc)

    def _refusal(self, path: str) -> str | None:
        async_save = self.checkpoint._config.async_save  # noqa: SLF001  (no public accessor)
        if async_save:
            return (f"{type(self.checkpoint).__name__} saves asynchronously (async_save={async_save!r}): a file may "
                    "still be written after its save returned, so saves are not committed")
        if rank_file_manifest(path) is None or not os.path.isfile(path):
            return f"{os.path.basename(path)} is not a per-rank <prefix>-<epoch>_<step>.ckpt file: not committed"
        return None


class ResumeCallback(Callback):
    """Loads the newest intact checkpoint of ``directory`` for this rank at train begin, and commits
    every save of the run's ``ModelCheckpoint`` (:class:`SaveCommitter`).

    The choice is made at construction, so ``initial_epoch(steps_per_epoch)`` can be passed to
    ``Model.train``; broken, truncated, uncommitted and ``_breakpoint`` checkpoints are skipped with
    the reason. Without ``directory`` the run's ``ModelCheckpoint`` directory is searched at train begin.
    """

    def __init__(self, directory: str = "", format: str = "auto", runtime: Runtime | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.resume = _runtime_for("resume", runtime, options).running(Resume)
        self.format = format
        self.selection = None
        if self.resume is not None and directory:
            self._choose(directory)

    def _choose(self, directory: str) -> None:
        if os.path.isdir(directory):
            self.selection = self.resume.choose(directory, self.format, rank=global_rank())
        else:
            log.info("resume: %s does not exist yet; starting from scratch", directory)

    def initial_epoch(self, steps_per_epoch: int) -> int:
        """``Model.train``'s ``initial_epoch``: the chosen checkpoint's epoch if it ended it, else the one before.

        ``Model.train`` cannot start inside an epoch, so a mid-epoch checkpoint repeats that epoch's
        first steps; the log says how many.
        """
        if self.selection is None or self.selection.epoch is None:
            return 0
        epoch, step = self.selection.epoch, self.selection.step or 0
        if step >= steps_per_epoch:
            return epoch
        log.warning("resume: %s is %d steps into epoch %d; Model.train restarts that epoch",
                    self.selection.path, step, epoch)
        return epoch - 1

    def on_train_begin(self, run_context: RunContext) -> None:
        if self.resume is None:
            return
        cb_params = run_context.original_args()
        checkpoint = _checkpoint_callback(cb_params)
        if checkpoint is not None:
            if self.selection is None:
                self._choose(_save_root(checkpoint._directory))  # noqa: SLF001
            SaveCommitter.attach(checkpoint, self.resume)
        if self.selection is None or self.selection.path is None:
            return
        from mindspore import load_checkpoint, load_param_into_net

        parameters = load_checkpoint(self.selection.path)
        load_param_into_net(cb_params.train_network, parameters)
        steps_per_epoch = cb_params.batch_num
        cb_params.cur_step_num = self.initial_epoch(steps_per_epoch) * steps_per_epoch
        log.info("resume: loaded %s (epoch %s, step %s)", self.selection.path, self.selection.epoch,
                 self.selection.step)


class FaultTolerance(Callback):
    """The one entry: the configured features (``FT_PLUGINS``, as on PyTorch) as one MindSpore callback.

    ``features``: ``"auto"``, ``"all"``, ``"none"``, a comma string or a list; default ``FT_PLUGINS``.
    ``strict``: refuse to train when a requested feature cannot work (default ``FT_PLUGINS_STRICT``).
    ``resume_dir`` / ``resume_format``: where to resume from (default: the run's checkpoint directory).
    Per-feature options as mappings, e.g. ``taskd={"disk_limit_mb": 2000}`` or in YAML::

        callbacks:
          - type: FaultTolerance
            features: taskd,mstx,ttp
            taskd: {disk_limit_mb: 2000}
    """

    def __init__(self, features: str | Sequence[str] | None = None, strict: bool | None = None,
                 resume_dir: str = "", resume_format: str = "auto", **options: Mapping[str, Any]) -> None:
        super().__init__()
        env = None if strict is None else {**os.environ, STRICT_VAR: "1" if strict else "0"}
        self.runtime = activate(FRAMEWORK, features=features, options=options, env=env)
        parts: list[Callback] = []
        if self.runtime.feature("resume") is not None:
            self.resume: ResumeCallback | None = ResumeCallback(resume_dir, resume_format, runtime=self.runtime)
            parts.append(self.resume)
        else:
            self.resume = None
        for name, part in (("taskd", TaskdWorkerCallback), ("ttp", TtpCallback), ("mstx", StepRangesCallback)):
            if self.runtime.feature(name) is not None:
                parts.append(part(runtime=self.runtime))
        self.parts = parts

    def initial_epoch(self, steps_per_epoch: int) -> int:
        """See :meth:`ResumeCallback.initial_epoch`; 0 when resume is off."""
        return self.resume.initial_epoch(steps_per_epoch) if self.resume is not None else 0

    def on_train_begin(self, run_context: RunContext) -> None:
        for part in self.parts:
            part.on_train_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        for part in self.parts:
            part.on_train_step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        for part in reversed(self.parts):
            part.on_train_step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        for part in reversed(self.parts):
            part.on_train_end(run_context)
