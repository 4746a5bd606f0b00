"""MindSpore glue for the job's events (:mod:`ft_plugins.events`), as
:mod:`ft_plugins.torch.megatron.recording` is Megatron's.

The record begins beside the run's checkpoints (``<root>/ft_events``, the root holding the ``rank_N`` folders: the
resume directory, MindFormers' checkpoint folder, or the ``ModelCheckpoint``'s) unless ``FT_PLUGINS_EVENTS_DIR``
names a folder; begun once that folder is known, it is dated from the process's start. Then: set-up done and
training's end, each step (kept in memory, written in batches), each save of the run's ``ModelCheckpoint``
(MindFormers' ``CheckpointMonitor`` is one) with its step and this rank's bytes, and what the built-in dump
(:mod:`.dump`) sees: a peer's exit (naming its rank), SIGTERM, a stalled step, the dump written. msrun SIGKILLs the
survivors a moment after a worker's death: the steps kept in memory are written as the fault is noticed.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from mindspore.train import Callback, RunContext

from ft_plugins import events
from ft_plugins.mindspore.base import checkpoint_callback, save_root
from ft_plugins.rank import env_rank

SAVING = ("step_end", "end")  # where ModelCheckpoint (and CheckpointMonitor) saves


def begin(directory: str) -> None:
    """Begin this worker's record beside the checkpoints under ``directory`` (a no-op once begun)."""
    events.start("worker", beside=save_root(directory) if directory else None, since=events.process_started())


def peer_ranks(pids: list[int]) -> dict[int, int | None]:
    """The rank of each of this node's other workers, read while they run (a dead one's environment is gone)."""
    found: dict[int, int | None] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                pairs = (item.partition(b"=") for item in handle.read().split(b"\0") if item)
                found[pid] = env_rank({key.decode(): value.decode(errors="replace") for key, _, value in pairs})
        except OSError:
            found[pid] = None
    return found


def peers_lost(ranks: list[int | None]) -> None:
    """Worker processes of this node exited: each a fault of its rank, seen by this survivor."""
    for rank in ranks:
        events.emit("fault", rank=rank, kind="death", noticed="peer")


def noticed(reason: str, kind: str) -> None:
    """This rank's own dying gasp begins (``signal``: SIGTERM; ``hang``: its step stalled)."""
    events.emit("gasp", reason=reason, kind=kind)


def dumped(step: int, seconds: float) -> None:
    events.emit("dump", step=step, seconds=round(seconds, 4), committed=True)


def written() -> None:
    """The record on disk once the dying gasp is: the fault's events are kept in memory until then, so that no
    write of theirs delays the dump (msrun's SIGKILL follows a death within a second)."""
    events.flush()


class EventsCallback(Callback):
    """Set-up done, the steps, the saves and the end of one ``Model.train`` (a part of ``FaultTolerance``)."""

    def __init__(self, directory: str = "") -> None:
        super().__init__()
        begin(directory)
        self.started: float | None = None
        self.checkpoint: Any = None

    def on_train_begin(self, run_context: RunContext) -> None:
        checkpoint = checkpoint_callback(run_context.original_args())
        begin(checkpoint._directory if checkpoint is not None else "")  # noqa: SLF001
        if not events.recording():
            return
        events.emit("setup_done")
        if checkpoint is not None:
            for name in SAVING:
                setattr(checkpoint, name, _recorded(checkpoint, getattr(checkpoint, name)))
            self.checkpoint = checkpoint

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.started = time.time()

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.started is not None:
            events.step(run_context.original_args().cur_step_num, self.started)

    def on_train_end(self, run_context: RunContext) -> None:
        events.emit("trained")

    def __exit__(self, *exc_info: object) -> None:
        """Model.train leaves its callbacks' context when training ends or raises: the save wrappers come off."""
        if self.checkpoint is not None:
            for name in SAVING:
                vars(self.checkpoint).pop(name, None)
            self.checkpoint = None


def _recorded(checkpoint: Any, saving: Callable[[RunContext], None]) -> Callable[[RunContext], None]:
    """``saving`` (on this instance, never its class), its save recorded when it made one: ModelCheckpoint decides
    inside, and moves its ``_last_triggered_step`` when it saved."""

    @functools.wraps(saving)
    def recorded(run_context: RunContext) -> None:
        before, began = checkpoint._last_triggered_step, time.time()  # noqa: SLF001
        saving(run_context)
        step = checkpoint._last_triggered_step  # noqa: SLF001
        if step != before:
            latest = checkpoint.latest_ckpt_file_name
            events.emit("save_start", step=step, t=round(began, 4))
            events.emit("save_end", step=step, bytes=events.size_on_disk(latest) if latest else None)

    return recorded
