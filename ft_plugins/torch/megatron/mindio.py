"""MindIO TTP as the trigger and driver of the dump (MindSpeed-LLM's wiring, done from the outside): the
same step tracker and Megatron dump writer as the built-in engine; MindIO's save handler writes the dump,
its rename handler commits it.

Hooks: ``_initialize_distributed`` (controller and processor start before ``init_process_group``),
``train`` (replicas, data-parallel group and handlers reported, then run under MindIO's exception handler),
the optimizer's update (reported to MindIO as the step it completes) and each completed step (MindIO's
pause point). No SIGTERM watcher: MindIO's save handler registration makes SIGTERM and SIGINT do nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

from ft_plugins.features.ttp import Ttp
from ft_plugins.rank import env_rank
from ft_plugins.steps import UPDATED, StepTracker
from ft_plugins.torch.megatron.dump import MegatronDump
from ft_plugins.torch.megatron.state import megatron, megatron_args
from ft_plugins.logs import exit_now
from ft_plugins.triggers import EXIT_ON_ERROR, UPDATE_WAIT, ignore_children
from ft_plugins.vendors.mindio import TorchProcess, load_framework_api, zit_lacking

log = logging.getLogger("ft_plugins.ttp")


class MindioDriver:
    """MindIO's side of the ``ttp`` glue: its process, its handlers, its reports."""

    def __init__(self, feature: Ttp, tracker: StepTracker, writer: MegatronDump) -> None:
        self.feature = feature
        self.tracker = tracker
        self.writer = writer
        self.process: TorchProcess | None = None
        self.recovery: Any = None  # recover's MindIO handlers (:mod:`.mindio_recover`), when recover is on

    # -- wrappers (wrapt signature) ----------------------------------------------------------------
    def initialize_distributed(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            process = TorchProcess(load_framework_api(), self.feature.where)  # imports torch_npu: only now
            # before init_process_group: the launcher's variables are the only source of the rank
            zit = bool(getattr(self.recovery, "ZIT", False))
            process.start(env_rank() or 0, int(os.environ.get("WORLD_SIZE", "1")), os.environ,
                          arf=self.recovery is not None, zit=zit)
            self.process = process
            if zit and not process.zit:  # recover's handlers and the dump stay
                self.recovery.without_zit(zit_lacking(process.api))
            if self.recovery is not None and process.rebooted():
                self.recovery.replacing()
        except Exception as exc:  # never into training: the run goes on without dying-gasp saves
            log.warning("ttp: the mindio engine is off for this run: %s: %s", type(exc).__name__, exc)
        return wrapped(*args, **kwargs)

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.process is None or self.writer.refused("mindio"):
            return wrapped(*args, **kwargs)
        handlers = {"save_ckpt": self.save, "rename": self.rename, "exit": self.exit}
        handlers.update(self.recovery.handlers() if self.recovery is not None else
                        {kind: _declined(kind) for kind in ("stop", "clean", "repair", "rollback", "rebuild_group")})
        handlers["stream_sync"] = _synchronize
        try:
            self.process.wire(*layout(), handlers)
            guarded = self.process.guarded(wrapped)
        except Exception as exc:  # e.g. a MindIO without one of these calls: train on, without it
            log.warning("ttp: the mindio engine is off for this run: %s: %s", type(exc).__name__, exc)
            self.process = None
            return wrapped(*args, **kwargs)
        return guarded(*args, **kwargs)

    def report_layout(self, numbering: Sequence[int]) -> None:
        """Report the groups as they stand again, MindIO's rank of torch's rank r being ``numbering[r]`` (after a
        downgrade the ranks are numbered anew; MindIO's are not)."""
        if self.process is not None:
            self.process.report_layout(*layout(numbering))

    def update(self, call: Callable[[], Any]) -> Any:
        """The optimizer's own update reported to MindIO as the step it completes (``tft_start_updating_os``
        raises once a dump has started: the update never begins under a dump)."""
        if self.process is None or self.tracker.inside_update or self.tracker.payload is None:
            return self.tracker.update(call)
        self.process.start_update()
        ok = self.tracker.update(call)
        self.process.end_update(self.tracker.completed + 1)
        return ok

    def step_failed(self) -> None:
        """MindIO's exception handler takes the error to the controller; the main thread changes nothing more
        (and, unless recover may repair this process, waits there for MindIO's dump and exit)."""
        self.tracker.stand_still()
        if self.recovery is None:
            ignore_children()

    def step_completed(self, completed: int) -> None:
        if self.process is not None:
            self.process.pause(completed)

    # -- MindIO's handlers -------------------------------------------------------------------------
    def save(self, step: int, save_info: Any, args: Any, ctx: Any) -> None:
        """Write this rank's part of the dump of ``step`` (MindIO calls this in a thread of its own)."""
        frozen = self.tracker.freeze(UPDATE_WAIT, exclusive=False)
        if frozen is not None and not frozen.torn:
            last = frozen.completed + (1 if frozen.phase == UPDATED else 0)
            if last != step:
                log.warning("ttp: MindIO asks for step %d, the last completed step here is %d", step, last)
        self.writer.save(f"MindIO dump of step {step}", frozen, commit=False)

    def rename(self, step: int, args: Any) -> None:
        """Commit the dump of ``step`` (idempotent: any survivor, or the next start-up, may complete it)."""
        log.warning("ttp: MindIO rename of step %d: %s", step, self.writer.commit(self.writer.save_dir(), step))

    def exit(self, *args: Any) -> None:
        exit_now(EXIT_ON_ERROR)


def layout(numbering: Sequence[int] | None = None) -> tuple[int, list[dict[str, object]], list[int]]:
    """This rank, its optimizer replicas and its data-parallel group as MindIO numbers them (``numbering``: MindIO's
    rank of each torch rank; None: the same)."""
    import torch.distributed as dist

    from ft_plugins.replicas import ReplicaLayout

    mindio_rank = numbering.__getitem__ if numbering is not None else int
    dp_ranks = [mindio_rank(rank) for rank in
                dist.get_process_group_ranks(megatron("core.parallel_state").get_data_parallel_group())]
    parsed = megatron_args()
    # the distributed optimizer holds each shard once per instance; the non-distributed one, on every rank
    replicas = parsed.num_distributed_optimizer_instances if parsed.use_distributed_optimizer else len(dp_ranks)
    return mindio_rank(dist.get_rank()), ReplicaLayout.build(dp_ranks, replicas).mindio_replica_info(), dp_ranks


def _declined(kind: str) -> Callable[..., None]:
    """Handlers for what the dump-only engine does not do (repair in place, rollback, rebuild): MindIO
    falls back to the dump when they raise; stop and clean have nothing to undo here."""
    def handler(*args: Any) -> None:
        if kind in ("stop", "clean"):
            log.info("ttp: MindIO %s: nothing to do (the main thread changes no state once a dump starts)", kind)
            return
        raise RuntimeError(f"MindIO {kind} is not supported by ft_plugins' dump-only engine")

    handler.__name__ = f"ft_plugins_{kind}"
    return handler


def _synchronize(*args: Any) -> None:
    import torch

    device = getattr(torch, "npu", None) or torch.cuda  # torch_npu adds torch.npu
    if device.is_available():
        device.synchronize()
