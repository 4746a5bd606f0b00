"""``ttp`` for the Trainer (data parallel): on a peer's loss or SIGTERM a survivor writes the last completed
optimizer step K as HF's own ``checkpoint-K``, committed, so plain ``resume_from_checkpoint=True``
continues at K + 1 with no step lost.

Composed from the framework-neutral parts: a :class:`~ft_plugins.steps.StepTracker` driven by the
Trainer's ``on_step_begin`` / ``on_step_end`` and by Accelerate's ``AcceleratedOptimizer.step`` (the
update, bracketed: a rank caught inside it is never saved half-updated), and a
:class:`~ft_plugins.triggers.DyingGasp` fired by SIGTERM (watcher thread) or by an exception leaving
``Trainer.train`` (a collective that raised when a peer died). In DDP every rank holds the whole model
and optimizer, so one survivor writes them; the writer is the first to ``add`` a key on torchrun's store
(no collective). The ranks' generators drift apart (Accelerate keeps only the sampler's in step), so each
rank's RNG file is its own, taken at the end of step K as a save at K would hold it: every other survivor
hands its file to the writer on the same store, the writer puts every file that came into the checkpoint
before the commit, and a lost rank's as a copy of its own, said in one line (:mod:`.rng_files`: why a
copy, how long the writer waits). FSDP and DeepSpeed shard the state: refused with one line. On a GPU or NPU the
dump copies on a stream of its own once the device ran the step's work, as Megatron's does (:mod:`ft_plugins.torch
.device`: a mark at each step's start and after each update).

A ``checkpoint-K`` there already (the save of K the fault interrupted, or, with ``resume`` off, a complete one that
was never committed) is replaced so that a whole one, old or new, stands at ``checkpoint-K`` at every instant: the
committed staging folder and it swap places in one rename (``renameat2``'s ``RENAME_EXCHANGE``), then the old one
is removed. Where the file system cannot swap (NFS) the old one steps aside to ``tmp-checkpoint-K.replaced`` first;
a crash between those two renames leaves no ``checkpoint-K`` until the next start. What a crash leaves at any point
is finished as the next ``Trainer`` is built (:func:`tidy`, on rank 0, the other ranks waiting for it).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ft_plugins import events
from ft_plugins.checkpoint import commit as commit_checkpoint
from ft_plugins.faults import RESTART_VAR
from ft_plugins.features.ttp import Ttp
from ft_plugins.patching import Patch
from ft_plugins.steps import FORWARD, IDLE, Frozen, StepTracker
from ft_plugins.rank import global_rank
from ft_plugins.torch import saving
from ft_plugins.torch.abort import abort_for_dump
from ft_plugins.torch.device import DeviceMarks
from ft_plugins.torch.hf.agree import agree
from ft_plugins.torch.hf.rotation import committed
from ft_plugins.torch.hf.rng import RngState, restore
from ft_plugins.torch.hf.rng_files import PEER_WAIT, gather, offer, own_file, write_files
from ft_plugins.torch.hf.targets import TRAINER
from ft_plugins.torch.store import claim
from ft_plugins.triggers import EXIT_ON_ERROR, DyingGasp

log = logging.getLogger("ft_plugins.ttp")

LEFT_OVER = re.compile(r"^tmp-checkpoint-(\d+)(\.replaced)?$")  # a dump's staging folder, or an old one put aside
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@dataclass
class _At:
    """What a save of the step boundary needs: the Trainer and the RNG state taken there."""

    trainer: Any
    rng: dict[str, Any]


class TrainerDump:
    def __init__(self, feature: Ttp) -> None:
        self.feature = feature
        self.tracker = StepTracker()
        self.gasp = DyingGasp(self.tracker, self.save)
        self.marks = DeviceMarks()  # the step boundaries on the device: the dump copies behind the latest
        self._refusal: str | None = None
        self._rng: dict[str, Any] | None = None
        self._take_rng = RngState().take
        self._trainer: Any = None
        self._starts = 0  # Trainers built by this process: each one's tidy is a question of its own

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINER, "Trainer.__init__", self.init),
                Patch(TRAINER, "Trainer.train", self.train),
                Patch("accelerate.optimizer", "AcceleratedOptimizer.step", self.update))

    # -- hooks -------------------------------------------------------------------------------------
    def init(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        """What a crash left of a dump's replacement, finished by rank 0 while the other ranks wait: before
        ``Trainer.train`` (or a script, once it built its Trainer) looks for the last checkpoint."""
        result = wrapped(*args, **kwargs)
        run_dir = self.feature.settings["save_dir"] or getattr(trainer.args, "output_dir", None)
        if run_dir:
            self._starts += 1
            agree(f"ttp/tidy/{self._starts}/{os.path.abspath(run_dir)}", lambda: _tidied(run_dir))
        return result

    def train(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        self._refusal, self._trainer = _unsupported(trainer), trainer
        if self._refusal:
            log.warning("ttp: the builtin engine is off for this run: %s", self._refusal)
            return wrapped(*args, **kwargs)
        _stand_down_jit_checkpoint(trainer)
        self.gasp.watch_sigterm()
        try:
            return wrapped(*args, **kwargs)
        except Exception as exc:
            if self.tracker.payload is None:  # before the first step: nothing to save, the error as it is
                raise
            self.gasp.fire(f"{type(exc).__name__} after step {self.tracker.completed}", EXIT_ON_ERROR, exc)
            raise

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self.tracker.update(self.marks.after(lambda: wrapped(*args, **kwargs)))

    def on_event(self, event: str, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        if self._refusal is None or self._refusal:
            return  # not inside a Trainer.train this feature serves
        if event == "step_begin":
            if self._rng is None:
                self._rng = self._take_rng()
            self.marks.mark()  # what the device runs before it is the last completed step's
            self.tracker.begin(state.global_step, _At(self._trainer, self._rng))
        elif event == "step_end":
            self.tracker.end(self._advance)

    def _advance(self, at: _At) -> None:
        """Under the tracker's lock, as the step completes: the RNG a save of this step holds."""
        self._rng = at.rng = self._take_rng()

    # -- the dump ----------------------------------------------------------------------------------
    def save(self, reason: str, frozen: Frozen | None) -> None:
        """Write ``checkpoint-K`` once, from one survivor; never raises (the exit follows)."""
        started = time.monotonic()
        try:
            abort_for_dump(reason)
            why_not = _nothing_to_save(frozen)
            if why_not:
                log.warning("ttp: %s: nothing to dump (%s)", reason, why_not)
                return
            assert frozen is not None
            with self.marks.side_stream(self.feature.settings["device_wait"]):
                self._write(reason, started, frozen.payload, frozen.completed)
        except Exception as exc:  # never a half-committed dump: the commit comes last
            log.error("ttp: dump failed: %s: %s", type(exc).__name__, exc)

    def _write(self, reason: str, started: float, at: _At, step: int) -> None:
        trainer = at.trainer
        run_dir = self.feature.settings["save_dir"] or trainer.args.output_dir
        final = os.path.join(run_dir, f"checkpoint-{step}")
        if committed(final):
            log.warning("ttp: %s: checkpoint-%d is saved already; nothing to dump", reason, step)
            return
        key = f"ft_plugins/hf/ttp/{os.environ.get(RESTART_VAR, '0')}/{step}"
        rank, world = trainer.args.process_index, trainer.args.world_size
        if not claim(key):
            offer(key, rank, own_file(trainer, at.rng))
            log.debug("ttp: %s: another survivor writes checkpoint-%d; this rank's RNG file handed to it",
                      reason, step)
            return
        staging = os.path.join(run_dir, f"tmp-checkpoint-{step}")
        shutil.rmtree(staging, ignore_errors=True)
        _write_checkpoint(trainer, staging, at.rng)
        lost = write_files(staging, gather(key, world, rank, started + PEER_WAIT), world, rank)
        if lost:
            log.warning("ttp: %s: no RNG state came from rank(s) %s within %.0f s (lost, their state with them): "
                        "their rng_state files in checkpoint-%d are copies of rank %d's", reason,
                        ", ".join(map(str, lost)), PEER_WAIT, step, rank)
        from ft_plugins.checkpoint.layouts.hf import HuggingFace

        if not set(os.listdir(staging)) & set(HuggingFace.WEIGHTS):
            raise RuntimeError(f"the Trainer wrote no model weights into {staging}: not committed")
        commit_checkpoint(staging)
        put_in_place(staging, final)
        self.feature.saves.append(final)
        seconds = time.monotonic() - started
        log.warning("ttp: %s: rank %d dumped %s in %.0f ms; committed", reason, global_rank(), final, seconds * 1000)
        events.emit("dump", step=step, seconds=round(seconds, 4), committed=True)


def put_in_place(staging: str, final: str) -> None:
    """The committed ``staging`` becomes ``final``. A ``final`` there already (never committed: a committed one is
    never replaced) is swapped with it in one rename, then removed; where the file system cannot swap, it steps
    aside first (:func:`tidy` finishes a replacement a crash cut short)."""
    if not os.path.exists(final):
        os.replace(staging, final)
        return
    if _exchange(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # the old one now: the dump is in place whatever happens to it
        return
    aside = f"{staging}.replaced"
    os.replace(final, aside)
    os.replace(staging, final)
    shutil.rmtree(aside, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _renameat2() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library older than glibc 2.28
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def _exchange(first: str, second: str) -> bool:
    """Swap two folders in one rename; False where the kernel or the file system cannot (NFS, FUSE, Linux before
    3.15), and nothing moved."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), first, None, second)


def tidy(run_dir: str) -> None:
    """What a crash left of a dump's replacement of ``checkpoint-K`` in ``run_dir``, each step with one line: a
    committed dump still staged goes in place of an uncommitted (or missing) ``checkpoint-K``; an old one put aside
    comes back where there is neither; a ``tmp-checkpoint-K`` beside a committed ``checkpoint-K`` (the old one after
    a swap) and an old one aside beside any ``checkpoint-K`` are removed. A staged dump never committed (its writer
    died writing it) is left for the next dump of K to replace."""
    try:
        names = os.listdir(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    for step in sorted({int(match.group(1)) for match in map(LEFT_OVER.match, names) if match}):
        final = os.path.join(run_dir, f"checkpoint-{step}")
        staging = os.path.join(run_dir, f"tmp-checkpoint-{step}")
        aside = f"{staging}.replaced"
        if committed(staging) and not committed(final):
            put_in_place(staging, final)
            log.warning("ttp: %s: the committed dump in %s put in place (a crash had cut its replacement short)",
                        final, staging)
        elif os.path.isdir(aside) and not os.path.exists(final):
            os.replace(aside, final)
            log.warning("ttp: %s restored from %s (a crash had cut a dump's replacement short, and no committed "
                        "dump was left to take its place)", final, aside)
        for leftover, replaced in ((staging, committed(final)), (aside, os.path.exists(final))):
            if replaced and os.path.isdir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
                log.warning("ttp: removed %s, left by a crash as the dump replaced %s", leftover, final)


def _tidied(run_dir: str) -> dict[str, Any]:
    """:func:`tidy` for :func:`.agree.agree`: never raises (the other ranks wait for its answer)."""
    try:
        tidy(run_dir)
    except OSError as exc:
        log.error("ttp: what a crash left in %s could not be tidied: %s", run_dir, exc)
    return {}


def _nothing_to_save(frozen: Frozen | None) -> str:
    if frozen is None:
        return "no step began"
    if frozen.torn:
        return "this rank was caught inside its optimizer update"
    if frozen.phase not in (FORWARD, IDLE):
        return "this rank stopped between its optimizer update and the end of the step"
    if frozen.completed == 0:
        return "no step completed"
    return ""


def _write_checkpoint(trainer: Any, directory: str, rng: dict[str, Any]) -> None:
    """What ``Trainer._save_checkpoint`` at this step writes, from this rank alone: model and training
    arguments (``_save``), optimizer, scheduler, this rank's RNG file, ``trainer_state.json``; the optimizer's
    archive (the largest file: the moments in fp32) ``torch.save``'s, its CRC-32s by zlib-ng (:mod:`..saving`)."""
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

    os.makedirs(directory, exist_ok=True)
    with _as_process_zero(trainer.args):
        trainer._save(directory)
    saving.save(trainer.optimizer.state_dict(), os.path.join(directory, OPTIMIZER_NAME))
    saving.save(trainer.lr_scheduler.state_dict(), os.path.join(directory, SCHEDULER_NAME))
    restore(rng)  # this process exits after the dump: its own RNG no longer matters
    trainer._save_rng_state(directory)
    _export_callback_states(trainer)
    trainer.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))


@contextmanager
def _as_process_zero(args: Any) -> Iterator[None]:
    """The dump's writer is whichever survivor claims it; transformers 5's ``_save`` writes the model only on process
    0: where ``should_save`` (read from ``distributed_state``), and then in ``save_pretrained`` only where torch's
    process group says rank 0. For the save, this process is alone (it exits after the dump; no collective follows)."""
    import torch.distributed

    state, initialized = getattr(args, "distributed_state", None), torch.distributed.is_initialized
    args.distributed_state, torch.distributed.is_initialized = None, lambda: False
    try:
        yield
    finally:
        args.distributed_state, torch.distributed.is_initialized = state, initialized


def _export_callback_states(trainer: Any) -> None:
    """The callbacks' states into the trainer state, as ``_save_checkpoint`` puts them (transformers 4.41 on;
    before, callbacks kept no state in checkpoints)."""
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:
        return
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            name, state = type(callback).__name__, callback.state()
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(state)
            else:
                trainer.state.stateful_callbacks[name] = state


def _stand_down_jit_checkpoint(trainer: Any) -> None:
    """transformers 5's ``enable_jit_checkpoint`` saves on SIGTERM too; one saver acts, never both. The dump
    stays: it also saves on a peer's loss, where a survivor blocked in a collective never reaches the step
    callback the just-in-time save waits for, and it writes at once, not ``kill_wait`` seconds later."""
    for callback in getattr(trainer.callback_handler, "callbacks", ()):
        manager = getattr(callback, "jit_manager", None)
        if manager is None:
            continue
        callback.jit_manager = None
        if signal.getsignal(signal.SIGTERM) == getattr(manager, "_sigterm_handler", None):
            signal.signal(signal.SIGTERM, getattr(manager, "_original_sigterm_handler", None) or signal.SIG_DFL)
        log.warning("ttp: transformers' enable_jit_checkpoint stands down: ttp's dump saves on SIGTERM (and on a "
                    "peer's loss)")


def _unsupported(trainer: Any) -> str:
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP shards the model and optimizer; a survivor cannot write every shard (DDP only for now)"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed shards the optimizer state; a survivor cannot write every shard (DDP only for now)"
    return ""
