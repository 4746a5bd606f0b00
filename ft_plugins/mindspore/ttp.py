"""``ttp`` on MindSpore: MindSpore's own ``TrainFaultTolerance`` (MindIO TTP), checked and wired to the run;
or, without MindIO, the built-in engine (:mod:`ft_plugins.mindspore.dump`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import mindspore
from mindspore.train import Callback, RunContext

from ft_plugins.features.resume import Resume
from ft_plugins.features.ttp import Ttp
from ft_plugins.mindspore.base import before_step_ends, checkpoint_callback, runtime_for
from ft_plugins.mindspore.dump import STAGING_PREFIX, DumpEngine
from ft_plugins.runtime import Runtime

log = logging.getLogger("ft_plugins.mindspore")


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


def builtin_problem(cb_params: Any) -> str | None:
    """Why the built-in engine could not write every rank's state from a survivor's, or None: it needs each
    rank to hold a whole replica (plain data parallel, no optimizer sharding) and a host step end per step."""
    from mindspore import context

    sink_size = cb_params.get("sink_size", -1)
    if cb_params.get("dataset_sink_mode", False) and sink_size != 1:
        return (f"sink_size={sink_size}: the host sees a step end only every sink of steps, so the last completed step "
                "is not known; train with sink_size=1 or dataset_sink_mode=False")
    mode = context.get_auto_parallel_context("parallel_mode")
    if mode not in ("stand_alone", "data_parallel"):
        return (f"parallel mode {mode}: ranks hold different shards, some with a single holder, and the built-in "
                "engine writes every rank's file from one replica; use MindIO TTP (MS_ENABLE_TFT='{TTP:1}')")
    if context.get_auto_parallel_context("enable_parallel_optimizer"):
        return ("the parallel optimizer shards optimizer state over the data-parallel ranks, and the built-in "
                "engine writes every rank's file from one replica; use MindIO TTP (MS_ENABLE_TFT='{TTP:1}')")
    return None


class TtpCallback(Callback):
    """Drives MindSpore's own ``TrainFaultTolerance`` (MindIO TTP) after checking what it needs, or the
    built-in engine where MindIO TTP is not switched on and ``ttp`` was asked for by name.

    Checked before the first step: MindSpore 2.5+, no ``TrainFaultTolerance`` already in the run
    (MindFormers 1.5+ injects one when ``MS_ENABLE_TFT`` is set), ``sink_size`` <= 1, a data-parallel
    replica, an optimizer wrapped for TFT (MindIO); :func:`builtin_problem` (built-in). The dying-gasp
    checkpoint is written where, and named as, the run's regular checkpoints, so that resume finds it.
    """

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        super().__init__()
        self.runtime = runtime_for("ttp", runtime, options)
        self.ttp = self.runtime.running(Ttp)
        self.delegate: Any = None
        self.engine: DumpEngine | None = None
        self.unhook: Callable[[], None] = lambda: None
        if self.ttp is not None and self.ttp.engine == "builtin":
            self.engine = DumpEngine(self.runtime, self.ttp)
        elif self.ttp is not None and not hasattr(mindspore.train, "TrainFaultTolerance"):
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
        cb_params = run_context.original_args()
        if self.engine is not None:
            self._begin_builtin(cb_params)
            return
        from mindspore.train.callback import TrainFaultTolerance

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

    def _begin_builtin(self, cb_params: Any) -> None:
        problem = builtin_problem(cb_params)
        if problem is None:
            try:
                self.engine.begin(cb_params)
                self.unhook = before_step_ends(cb_params, self.engine.step_completed)
                return
            except ValueError as exc:
                problem = str(exc)
        self.engine = None
        self._off(problem)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self.engine is not None:
            self.engine.step_begin()
        elif self.delegate is not None:
            self.delegate.on_train_step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.engine is not None:
            self.engine.step_end(run_context.original_args())
        elif self.delegate is not None:
            self.delegate.on_train_step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        if self.engine is not None:
            self.engine.end()
        if self.delegate is not None:
            self.delegate.on_train_end(run_context)
            self.delegate = None

    def __exit__(self, exc_type: Any, *exc_info: object) -> None:
        """Model.train leaves its callbacks' context when training ends or raises: the step-end hook comes off;
        when it raised, the built-in engine writes the last completed step before the error goes on."""
        self.unhook()
        if self.engine is not None and exc_type is not None and not self.engine.stopped.is_set():
            self.engine.end()
            self.engine.dump_safely(f"training raised {exc_type.__name__}")  # never hides the training error

    def _save(self, cb_params: Any, append_dict: dict[str, Any]) -> None:
        """MindIO's save handler (in its own thread): this rank's state as the run's next regular checkpoint."""
        from mindspore import save_checkpoint

        checkpoint = checkpoint_callback(cb_params)
        directory = self.ttp.settings["save_dir"] if self.ttp is not None else ""
        directory = directory or (checkpoint._directory if checkpoint is not None else "")  # noqa: SLF001
        if not directory:
            raise RuntimeError("ttp: nowhere to save: no ModelCheckpoint in the run and FT_PLUGINS_TTP_SAVE_DIR unset")
        prefix = checkpoint._prefix if checkpoint is not None else "ttp"  # noqa: SLF001
        step_in_epoch = (cb_params.cur_step_num - 1) % cb_params.batch_num + 1
        name = f"{prefix}-{cb_params.cur_epoch_num}_{step_in_epoch}.ckpt"
        resumed_at = getattr(checkpoint, "_append_step_num", 0) or 0  # a resumed run's ModelCheckpoint counts on
        append_dict.update(epoch_num=cb_params.cur_epoch_num, step_num=resumed_at + cb_params.cur_step_num)
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, name)
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
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
