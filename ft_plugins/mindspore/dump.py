"""``ttp``'s built-in engine on MindSpore (no MindIO): the survivors write the last completed step.

When a worker dies, msrun notices within a second and SIGKILLs every other worker (under ``ft-plugins run``,
SIGTERM and the run's grace come first): no handler, atexit or callback runs there, and the survivors' main
threads sit in the step's AllReduce, where reading a live parameter blocks behind the stuck collective. So the
state is copied to host memory at every step end (every parameter of the train network: weights, optimizer
state, step counter, learning rate), and a watcher thread writes that copy when

- a worker of this node exits while this rank is inside a step (its process is polled every 20 ms; one that
  said it ended training, :func:`_ended_mark`, is no loss: a faster peer leaves while this rank still saves): at
  once, and again as soon as the step in flight completes (its AllReduce may have completed before the loss);
  a dump of the older copy still under way then stops between two files, so the newer one is not kept waiting,
- a step has run for longer than ``STALL_STEPS`` times the median step, and at least ``STALL_FLOOR``
  seconds (a peer lost on another node), or
- SIGTERM arrives (a preemption, or ``ft-plugins run`` stopping msrun): written, then the process exits 143.

The copy is taken once the train network returned, before any callback's step end: a step is completed when
its update is, not when the callbacks listed before ours (a logger, a ``ModelCheckpoint`` saving) are done.

The copy is written as every rank's next regular checkpoint, ``rank_N/<prefix>-<epoch>_<step>.ckpt``
named as the run's ``ModelCheckpoint`` names its own, each file through a temporary name and a
rename, then committed with its manifest, so resume takes it like any save; the file system is synced once all
are, as the Megatron dump does (:mod:`ft_plugins.checkpoint.dump`): a SIGKILL during that wait loses nothing.
Data parallel keeps one replica per rank, so one survivor can write every rank's file: each file is claimed first
(:mod:`ft_plugins.checkpoint.claim`), so every file has one writer, and a claim held by a survivor killed mid-write
passes to another. A file already there (a regular save of that step) is
left alone. Layouts without a replica of every rank (model or optimizer parallel, sink size > 1) are
refused before the first step by :class:`ft_plugins.mindspore.ttp.TtpCallback`. Each dump's write, and each
regular save's, is recorded for the estimate of its time against msrun's (:mod:`.speed`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import stat
import statistics
import tempfile
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple

from ft_plugins.checkpoint import claim as claims
from ft_plugins.checkpoint.atomic import sync_file_system
from ft_plugins.features.resume import Resume
from ft_plugins.features.ttp import Ttp
from ft_plugins.logs import exit_now
from ft_plugins.mindspore import recording
from ft_plugins.mindspore.base import checkpoint_callback, global_rank, save_root
from ft_plugins.mindspore.speed import WriteSpeed
from ft_plugins.rank import is_rank_zero
from ft_plugins.processes import alive, all_pids, status
from ft_plugins.runtime import Runtime
from ft_plugins.triggers import EXIT_ON_SIGTERM, watch_signal

log = logging.getLogger("ft_plugins.ttp")

POLL = 0.02
STALL_STEPS = 10
STALL_FLOOR = 3.0
# a file of a dump is claimed first, then written in a staging folder: what a dump cut short leaves, cleared at start
CLAIM_PREFIX = ".ft_ttp_claim-"  # not named *.ckpt: a claim left must not read as a broken checkpoint at resume
STAGING_PREFIX = ".ft_ttp-"  # resume never sees half a file
ENDED_MARKS = "ft_plugins-ended-"  # + the user id: that user's private folder of the temporary directory, per node


class Snapshot(NamedTuple):
    """The host copy of one completed step."""

    epoch: int
    step: int  # MindSpore's global step counter
    step_in_epoch: int
    parameters: list[tuple[str, Any]]  # (name, numpy array), in the network's order
    loss_scale: Any = None  # what a loss-scaled step returned third, which MindFormers' saves keep as loss_scale


class Target(NamedTuple):
    """Where the dump goes and how its files are named: as the run's ModelCheckpoint names its own."""

    directory: str  # this rank's directory
    per_rank: bool  # ``<root>/rank_N`` directories: every rank's file is written
    prefix: str
    ranks: int
    append: dict[str, Any]  # ModelCheckpoint's append_dict and the counts it adds to it


class DumpEngine:
    """Host copies of each completed step and the watcher that writes the last one; driven by ``TtpCallback``."""

    def __init__(self, runtime: Runtime, ttp: Ttp) -> None:
        self.runtime = runtime
        self.ttp = ttp
        self.snapshot: Snapshot | None = None
        self.target: Target | None = None
        self.step_started: float | None = None  # monotonic time the running step began; None between steps
        self.durations: deque[float] = deque(maxlen=20)
        self.peers: list[int] = []
        self.peer_ranks: dict[int, int | None] = {}
        self.written: set[tuple[int, int]] = set()  # (step, rank) of the files this process tried to write
        self.lock = threading.Lock()
        self.looking = threading.Lock()  # over ``peers`` and ``loss``
        self.loss = ""  # the first loss of a peer seen, by whichever thread saw it
        self.stopped = threading.Event()
        self.copy_seconds = 0.0
        self.speed: WriteSpeed | None = None
        self.untime: Callable[[], None] = lambda: None

    # -- the training thread ----------------------------------------------------------------------
    def begin(self, cb_params: Any) -> None:
        self.target = self._target(cb_params)
        _clear_cut_short(self.target.directory)
        self.speed = WriteSpeed(save_root(self.target.directory))
        self.untime = self.speed.timed_saves(checkpoint_callback(cb_params))
        _clear_ended_marks()
        self.peers = _local_peers()
        self.peer_ranks = recording.peer_ranks(self.peers)
        if threading.current_thread() is threading.main_thread():
            # a thread woken by SIGTERM acts, whatever collective the main thread is blocked in
            watch_signal(signal.SIGTERM, self._on_sigterm, "ft_plugins-ttp-sigterm")
        threading.Thread(target=self._watch, name="ft_plugins-ttp-watcher", daemon=True).start()
        if is_rank_zero():  # rank 0 speaks for a healthy job
            log.info("ttp: built-in engine: host copy at every step end, written to %s on a lost peer (%d workers "
                     "of this node watched), a stalled step or SIGTERM", self.target.directory, len(self.peers))

    def step_begin(self) -> None:
        self.step_started = time.monotonic()

    def step_completed(self, cb_params: Any) -> None:
        """The host copy of the step whose update just finished, taken before any callback's step end
        (:func:`~ft_plugins.mindspore.base.before_step_ends`): a slow one listed before ours would otherwise
        leave the step before as the last completed one, and SIGTERM meanwhile would write that."""
        started = time.perf_counter()
        parameters = [(p.name, p.asnumpy().copy()) for p in cb_params.train_network.get_parameters()]
        step = cb_params.cur_step_num
        outputs = cb_params.net_outputs
        scale = outputs[2].asnumpy().copy() if isinstance(outputs, (tuple, list)) and len(outputs) >= 3 else None
        self.snapshot = Snapshot(cb_params.cur_epoch_num, step, (step - 1) % cb_params.batch_num + 1, parameters,
                                 scale)
        self.copy_seconds += time.perf_counter() - started
        if self.speed is not None and self.target is not None:  # what a dump of it would write: every rank's file
            files = self.target.ranks if self.target.per_rank else 1
            self.speed.warn(files, sum(array.nbytes for _, array in parameters))

    def step_end(self, cb_params: Any) -> None:
        """The step's time; its copy too where no hook took it before the step ends."""
        taken = self.snapshot is not None and (self.snapshot.epoch, self.snapshot.step) == (
            cb_params.cur_epoch_num, cb_params.cur_step_num)
        if not taken:
            self.step_completed(cb_params)
        if self.step_started is not None:
            self.durations.append(time.monotonic() - self.step_started)
        self.step_started = None

    def end(self) -> None:
        self.stopped.set()
        self.untime()
        _mark_ended()  # before this process exits: its peers still in their last step must not take it for a loss

    # -- the watcher ------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A lost peer: the copy of the last completed step is written at once (msrun's SIGKILL follows within a
        second); the step in flight may still complete (its AllReduce may be done), and its copy is then written
        too, at once: a step begun after the loss cannot complete."""
        reason, written = "", 0  # the loss seen (none yet), the newest step written since
        while not self.stopped.wait(POLL):
            started, snapshot = self.step_started, self.snapshot
            if not reason:
                if started is not None and self._newly_lost():
                    reason = self.loss
                    if snapshot is not None:  # at once: msrun's SIGKILL may come at its next poll, any moment
                        self.dump_safely(reason)
                        written = snapshot.step
                    else:
                        recording.written()
                elif started is not None and self.durations and time.monotonic() - started > self._stall():
                    recording.noticed(f"the step has run for over {self._stall():.1f} s", "hang")
                    self.dump_safely(f"the step has run for over {self._stall():.1f} s")
                    self.step_started = None  # once per stall
            elif snapshot is not None and snapshot.step > written:
                self.dump_safely(reason)
                written = snapshot.step

    def _stall(self) -> float:
        return max(STALL_FLOOR, STALL_STEPS * statistics.median(self.durations))

    def dump_safely(self, reason: str) -> None:
        try:
            self.dump(reason)
        except Exception as exc:  # the watcher keeps watching (SIGTERM may still come)
            log.warning("ttp: %s, but the dying-gasp checkpoint failed: %s: %s", reason, type(exc).__name__, exc)
        finally:
            recording.written()

    def _newly_lost(self) -> list[int]:
        """This node's workers that exited since the last look without marking their end, each recorded once as
        the loss of its rank (the watcher and the SIGTERM thread both look)."""
        with self.looking:
            gone = [pid for pid in self.peers if not alive(pid)]
            self.peers = [pid for pid in self.peers if pid not in gone]
            lost = [pid for pid in gone if not _has_ended(pid)]
            if lost and not self.loss:  # claimed here, so that a SIGTERM right after names it too
                self.loss = _exited(lost)
        if lost:
            recording.peers_lost([self.peer_ranks.get(pid) for pid in lost])
        return lost

    def _on_sigterm(self) -> None:
        self.stopped.set()  # this rank's own end: a peer ending after it is no fault of that peer,
        _mark_ended()  # nor this end a fault of this rank to its peers
        # msrun's SIGTERM answers a worker's exit: where it came before the watcher saw the exit, the exit is still
        # the fault, and the SIGTERM its consequence
        self._newly_lost()  # the watcher may have claimed the loss and not dumped yet: ``loss`` names it
        recording.noticed("SIGTERM", "signal")
        self.dump_safely(f"SIGTERM after {self.loss}" if self.loss else "SIGTERM")
        exit_now(EXIT_ON_SIGTERM)

    # -- the dump ---------------------------------------------------------------------------------
    def dump(self, reason: str) -> list[str]:
        """Write the last completed step as every rank's checkpoint this process may write; the paths written.
        Recorded and said under the lock too: SIGTERM meanwhile waits for all of it before the process exits."""
        with self.lock:
            snapshot, target = self.snapshot, self.target
            if snapshot is None or target is None:
                log.warning("ttp: %s, but no step has completed yet: nothing to write", reason)
                return []
            started = time.monotonic()
            written = []
            for rank in range(target.ranks) if target.per_rank else [None]:
                newer = self.snapshot
                if newer is not None and newer.step > snapshot.step:  # the rest waits for the newer copy's dump
                    log.warning("ttp: the dump of step %d stops for the newer step %d, completed meanwhile",
                                snapshot.step, newer.step)
                    break
                if (path := self._write(snapshot, target, rank)) is not None:
                    written.append(path)
            if not written:
                log.warning("ttp: %s: step %d already written (by a regular save or another survivor)", reason,
                            snapshot.step)
                return written
            seconds = time.monotonic() - started
            if self.speed is not None:
                self.speed.record(sum(map(os.path.getsize, written)), seconds, f"dump of step {snapshot.step}")
            recording.dumped(snapshot.step, seconds)
            log.warning("ttp: %s: dying-gasp checkpoint of step %d written in %.3f s: %s", reason, snapshot.step,
                        seconds, ", ".join(written))
            sync_file_system(target.directory)  # against a crash of the node; a SIGKILL from here on loses nothing
            return written

    def _write(self, snapshot: Snapshot, target: Target, rank: int | None) -> str | None:
        import mindspore

        me = global_rank() or 0
        key = (snapshot.step, me if rank is None else rank)
        if key in self.written:
            return None
        self.written.add(key)
        directory = target.directory if rank is None else os.path.join(save_root(target.directory), f"rank_{rank}")
        prefix = target.prefix if rank is None else re.sub(rf"rank_{me}(?=_|$)", f"rank_{rank}", target.prefix)
        path = os.path.join(directory, f"{prefix}-{snapshot.epoch}_{snapshot.step_in_epoch}.ckpt")
        claim = os.path.join(directory, f"{CLAIM_PREFIX}{os.path.basename(path).removesuffix('.ckpt')}")
        os.makedirs(directory, exist_ok=True)
        taken = claims.take(claim)
        if taken is None:
            return None  # another survivor writes this file
        staging = os.path.join(directory, f"{STAGING_PREFIX}{me}")
        try:
            if os.path.exists(path):
                return None
            # what the step left over the entries MindFormers' CheckpointMonitor sets at its own saves only (stale
            # until then): a parameter's value over an entry of its name (global_step), the step's loss scale
            held = {name for name, _ in snapshot.parameters}
            append = {name: value for name, value in target.append.items() if name not in held}
            append.update({name: value + (snapshot.epoch if name == "epoch_num" else snapshot.step)
                           for name, value in append.items() if name in ("epoch_num", "step_num")})
            if "loss_scale" in append and snapshot.loss_scale is not None:
                append["loss_scale"] = mindspore.Tensor(snapshot.loss_scale)
            os.makedirs(staging, exist_ok=True)
            partial = os.path.join(staging, os.path.basename(path))
            mindspore.save_checkpoint([{"name": name, "data": mindspore.Tensor(array)}
                                       for name, array in snapshot.parameters], partial, append_dict=append or None)
            os.replace(partial, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            claims.release(claim, taken)
        self.ttp.saves.append(path)
        resume = self.runtime.running(Resume)
        if resume is not None:
            resume.commit(path)
        return path

    def _target(self, cb_params: Any) -> Target:
        from mindspore.communication.management import GlobalComm, get_group_size

        checkpoint = checkpoint_callback(cb_params)
        directory = self.ttp.settings["save_dir"] or (checkpoint._directory if checkpoint is not None else "")  # noqa: SLF001
        if not directory:
            raise ValueError("no ModelCheckpoint in the run and FT_PLUGINS_TTP_SAVE_DIR unset: nowhere to write")
        prefix = checkpoint._prefix if checkpoint is not None and isinstance(checkpoint._prefix, str) else "ttp"  # noqa: SLF001
        append: dict[str, Any] = {}
        if checkpoint is not None:  # ModelCheckpoint adds the run's counts to these two entries of its append_dict
            append = dict(checkpoint._append_dict)  # noqa: SLF001
            for name, base in (("epoch_num", checkpoint._append_epoch_num), ("step_num", checkpoint._append_step_num)):  # noqa: SLF001
                if name in append:
                    append[name] = base
        ranks = get_group_size() if GlobalComm.INITED else 1
        per_rank = save_root(directory) != os.path.normpath(directory)
        return Target(directory, per_rank, prefix, ranks, append)


def _clear_cut_short(directory: str) -> None:
    """Remove what a dump SIGKILLed mid-write left in this rank's directory: its claims and staging folders.
    A claim left would keep every later launch from dumping that step. No dump runs yet: every rank begins
    before any step completes (the first step's collectives wait for all)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if name.startswith(CLAIM_PREFIX):
            os.unlink(path)
        elif name.startswith(STAGING_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


def _marks() -> str:
    """This user's folder of marks, private (0700): in the world-writable temporary directory a mark another user
    made, or a folder of theirs under the name, would hide a loss. OSError where the folder is not this user's own."""
    folder = os.path.join(tempfile.gettempdir(), f"{ENDED_MARKS}{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    found = os.lstat(folder)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of user {os.getuid()} (remove it)")
    return folder


def _ended_mark(pid: int) -> str:
    """The file by which worker ``pid`` of this node's msrun says it ended training (its exit is then no loss)."""
    return os.path.join(_marks(), str(os.getppid()), str(pid))


def _mark_ended() -> None:
    """Say to this node's peers that this worker's exit, to come, is no loss: training ended, or SIGTERM ends it."""
    try:
        mark = _ended_mark(os.getpid())
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        open(mark, "w").close()
    except OSError as exc:
        log.debug("ttp: the end of this worker not marked for this node's peers: %s", exc)


def _exited(pids: list[int]) -> str:
    return f"worker process {', '.join(map(str, pids))} of this node exited"


def _has_ended(pid: int) -> bool:
    """Whether worker ``pid`` marked its end of training (no mark to be had: not ended, a dump rather than a loss)."""
    try:
        return os.path.exists(_ended_mark(pid))
    except OSError:
        return False


def _clear_ended_marks() -> None:
    """Remove this process's mark left by an earlier process of its pid, and the marks of this user's launchers
    gone. No worker of this launch has ended yet: every rank begins before any step completes."""
    try:
        if os.path.exists(mine := _ended_mark(os.getpid())):
            os.unlink(mine)
        for name in os.listdir(_marks()):
            if name.isdigit() and not alive(int(name)):
                shutil.rmtree(os.path.join(_marks(), name), ignore_errors=True)
    except OSError as exc:  # a mark left makes a loss of that pid go unseen: said, never raised into training
        log.warning("ttp: marks of ended workers not cleared: %s", exc)


def _local_peers() -> list[int]:
    """The other msrun workers of this node: processes with this one's parent running this one's command line
    (msrun also starts its scheduler with it, and ``tail -f`` of each worker log: told apart by ``MS_ROLE``)."""
    me, parent = os.getpid(), os.getppid()
    try:
        with open(f"/proc/{me}/cmdline", "rb") as handle:
            command = handle.read()
    except OSError:
        return []
    peers = []
    for pid in all_pids():
        found = status(pid)
        if pid == me or found is None or found[1] != parent:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                same = handle.read() == command
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if same and b"MS_ROLE=MS_WORKER" in handle.read().split(b"\0"):
                    peers.append(pid)
        except OSError:
            continue
    return peers
