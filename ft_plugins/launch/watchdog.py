"""The launcher side of ``hangs``, inside the torchrun process: a rank that stops making progress is ended.

On each monitoring round of torchrun's agent (every ``--monitor-interval``, 0.1 s by default) the
:class:`Watchdog` reads its workers' progress files (:mod:`ft_plugins.progress`) and judges them
(:mod:`.stalls`). For a hang it logs the hung rank's stacks (all threads, asked for with SIGUSR2) with its
rank, step and section, sends it SIGTERM, and SIGKILL after the grace, or sooner when it shows no answer to
SIGTERM (a ``ttp`` dump reports itself as it begins); the round then goes on as usual, so the
death is handled as any: ``recover``'s :class:`~ft_plugins.launch.recover.Supervisor` replaces the rank in place,
else torchrun stops the others (``ttp``'s dump) and restarts the job as its ``--max-restarts`` allows. For every
rank stalled alike it says so in one line and answers the round as a failed worker group: the dump and the
restart, and no replacement. :class:`Watchdog` itself knows no launcher: msrun's process runs it too
(:mod:`.msrun_watch`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Mapping

from ft_plugins import events, progress
from ft_plugins.config import PROGRESS_VAR
from ft_plugins.features.hangs import Bounds
from ft_plugins.launch.process import wait_gone
from ft_plugins.launch.node_counts import NodeCounts
from ft_plugins.launch.scratch import owned_directory
from ft_plugins.launch.stalls import (ALL, HANG, WAIT, Verdict, Watch, ahead, behind, fewest, judge, main_frames,
                                     overdue, stuck, waits_on_peers)

log = logging.getLogger("ft_plugins.hangs")

AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
STACKS_WAIT = 2.0  # seconds the ranks asked get to write their stacks (a C signal handler: milliseconds)
EXIT_WAIT = 5.0  # seconds a SIGKILLed rank gets to be gone
ANSWER_WAIT = 0.2  # seconds a rank gets to show it answers SIGTERM (its dying gasp reports at once: milliseconds)
POLL = 0.05
WAIT_AGAIN = 1.0  # seconds before ranks that wait for a rank within its bound are asked for their stacks again


class Watchdog:
    """Watches the local workers' progress in torchrun's agent and ends a hung one."""

    def __init__(self, settings: Mapping[str, Any], directory: str) -> None:
        self.bounds = Bounds(settings)
        self.grace = float(settings["grace"])
        self.directory = directory
        self.watches: dict[int, Watch] = {}  # global rank -> the worker process watched
        self.answered: int | None = None  # the furthest step when a hang was last answered
        self._read_to: dict[int, int] = {}  # global rank -> how far its stacks file was read
        self._calm_until = 0.0  # after a wait verdict, the ranks are asked again only this late
        self._said = ""  # the last wait verdict said
        self._waiting: set[int] = set()  # the ranks the last wait verdict found waiting in a collective
        self.nodes: NodeCounts | None = None  # the other nodes' launchers (torchrun with ranks elsewhere)

    def install(self) -> None:
        """Wrap the agent's monitoring round (imported here: this runs in the torchrun process only)."""
        import importlib

        import wrapt

        agent = importlib.import_module(AGENT).LocalElasticAgent
        agent._monitor_workers = wrapt.FunctionWrapper(agent._monitor_workers, self.monitor)

    def monitor(self, wrapped: Callable[..., Any], agent: Any, args: tuple, kwargs: dict) -> Any:
        worker_group = kwargs.get("worker_group", args[0] if args else None)
        context = getattr(agent, "_pcontext", None)
        if worker_group is not None and context is not None and getattr(context, "subprocess_handlers", None):
            try:
                ranks = {worker.local_rank: worker.global_rank for worker in worker_group.workers}
                procs = {ranks[local]: handler.proc for local, handler in context.subprocess_handlers.items()}
                remote = worker_group.workers[0].world_size > len(procs)
                self._nodes(worker_group if remote else None)
                verdict = self.look(procs, remote, time.monotonic())
            except Exception as exc:  # never into torchrun's loop: a watchdog that fails leaves the job as it was
                log.warning("hangs: progress not read this round (%s: %s)", type(exc).__name__, exc)
                verdict = None
            if verdict is not None and verdict.kind == ALL:
                return _failed(worker_group, context)
        return wrapped(*args, **kwargs)

    def _nodes(self, worker_group: Any) -> None:
        """The other nodes' launchers, through this rendezvous round's store (None: this node alone)."""
        store = getattr(worker_group, "store", None)
        if store is None:
            self.nodes = None
        elif self.nodes is None or self.nodes.store is not store:
            self.nodes = NodeCounts(store, worker_group.group_rank, worker_group.group_world_size)

    def look(self, procs: Mapping[int, Any], remote: bool, now: float) -> Verdict | None:
        """Read the report of every local worker (``procs``: global rank -> its ``Popen``); act on a hang
        (``remote``: the job has ranks on other nodes too); the verdict when there was one."""
        for rank, proc in procs.items():
            if rank not in self.watches or self.watches[rank].pid != proc.pid:
                self.watches[rank] = Watch(proc.pid, now)  # a new process: set-up, until it reports
            self.watches[rank].observe(progress.read(self.directory, rank), now, self.bounds)
        for rank in set(self.watches) - set(procs):
            del self.watches[rank]
        stopped = stuck(self.watches, now, self.bounds)
        entered = self._entered(stopped)
        late = overdue(self.watches, now, self.bounds)
        if not late or now < self._calm_until:
            return None
        moving = [rank for rank, watch in self.watches.items() if watch.reporting and rank not in stopped]
        stacks = self.stacks(stopped)
        counted = ahead(entered, self.nodes.elsewhere() if self.nodes is not None else None)
        waiting = {rank: rank in counted or waits_on_peers(main_frames(stacks.get(rank, ""),
                                                                      self.watches[rank].record.thread))
                   for rank in stopped}
        furthest = max(watch.record.step for watch in self.watches.values() if watch.record is not None)
        patient = all(self.watches[rank].quiet(now) < 2 * self.watches[rank].bound(self.bounds) for rank in late)
        stalled = all(self.watches[rank].quiet(now) > self.bounds.settings["stall"] for rank in late)
        verdict = judge(stopped, moving, waiting, self.answered is not None and furthest <= self.answered, remote,
                        patient, stalled, self._waiting, behind(entered) - counted)
        self._waiting = set(verdict.victims) if verdict.kind == WAIT and not verdict.freed else set()
        for rank in verdict.freed:  # its wait for a peer ended just now: a full bound from here
            self.watches[rank].moved = now
        if verdict.kind == HANG:
            self.answered = furthest
            self._end(verdict, stacks, procs, now, counted)
        elif verdict.kind == ALL:
            self._all_stalled(verdict, stopped, stacks, now, remote)
        else:
            self._calm_until = now + WAIT_AGAIN
            if verdict.why != self._said:
                log.info("hangs: rank%s %s past %s bound, not ended: %s", "s" if len(late) > 1 else "",
                         ", ".join(map(str, sorted(late))), "their" if len(late) > 1 else "its", verdict.why)
            self._said = verdict.why
        return verdict

    def _entered(self, stopped: list[int]) -> dict[int, dict[int, int]]:
        """The collectives each reporting rank entered, per group, while some stand still (told to the other
        nodes); nothing read otherwise."""
        if not stopped:
            if self.nodes is not None:
                self.nodes.withdraw()
            return {}
        entered = {rank: progress.collectives(self.directory, rank)
                   for rank, watch in self.watches.items() if watch.reporting}
        if self.nodes is not None:
            self.nodes.publish(fewest(entered))
        return entered

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The stacks each rank writes when asked (SIGUSR2), as far as written within ``STACKS_WAIT``."""
        for rank in ranks:
            try:
                os.kill(self.watches[rank].pid, progress.STACKS_SIGNAL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACKS_WAIT
        while time.monotonic() < deadline and not all(self._read_stacks(rank) for rank in ranks):
            time.sleep(POLL)
        time.sleep(POLL)  # a dump under way ends
        return {rank: self._read_stacks(rank, keep=True) for rank in ranks}

    def _read_stacks(self, rank: int, keep: bool = False) -> str:
        path = progress.stacks_path(self.directory, rank)
        start = self._read_to.get(rank, 0)
        try:
            with open(path, errors="replace") as file:
                file.seek(start)
                text = file.read()
        except OSError:
            return ""
        if keep:
            self._read_to[rank] = start + len(text.encode())
        return text

    def _end(self, verdict: Verdict, stacks: Mapping[int, str], procs: Mapping[int, Any], now: float,
             counted: set[int]) -> None:
        """Log each culprit with its stacks, SIGTERM, SIGKILL after the grace; the others start their bound anew
        (``counted``: the ranks ahead of a peer in a group's collectives)."""
        for rank in verdict.culprits:
            watch = self.watches[rank]
            events.emit("fault", rank=rank, kind="hang", quiet=watch.quiet(now), section=watch.where(),
                        noticed="watchdog")
            log.error("hangs: rank %d (pid %d) made no progress for %.1f s in %s (bound %.1f s); it is ended "
                      "(SIGTERM; SIGKILL after %g s, or after %g s if it shows no answer to SIGTERM by then). Its "
                      "stacks:\n%s", rank, watch.pid, watch.quiet(now), watch.where(), watch.bound(self.bounds),
                      self.grace, min(self.grace, ANSWER_WAIT), stacks.get(rank, "").rstrip() or "(none written)")
        if verdict.victims:
            ahead_of = [rank for rank in verdict.victims if rank in counted]
            log.warning("hangs: rank%s %s wait%s for it in a collective%s", "s" if len(verdict.victims) > 1 else "",
                        ", ".join(map(str, verdict.victims)), "" if len(verdict.victims) > 1 else "s",
                        f" (ahead of a peer in a process group's collectives: {', '.join(map(str, ahead_of))})"
                        if ahead_of else "")
        stop([procs[rank] for rank in verdict.culprits], self.grace,
             answering(self.directory, {procs[rank].pid: rank for rank in verdict.culprits}))
        restart = time.monotonic()
        for watch in self.watches.values():
            watch.moved = max(watch.moved, restart)  # their peer's death reaches them now: a full bound again

    def _all_stalled(self, verdict: Verdict, stopped: list[int], stacks: Mapping[int, str], now: float,
                     remote: bool) -> None:
        where = sorted({self.watches[rank].where() for rank in stopped})
        log.error("hangs: every rank%s stalled (%d ranks quiet %.1f s or more, in %s): %s; the job dumps and "
                  "restarts as a whole, no rank is replaced", " of this node" if remote else "", len(stopped),
                  min(self.watches[r].quiet(now) for r in stopped), "; ".join(where), verdict.why)
        for rank in stopped:
            log.info("hangs: stacks of rank %d:\n%s", rank, stacks.get(rank, "").rstrip() or "(none written)")
        self.watches.clear()


def stop(procs: list[Any], grace: float, answers: Callable[[Any], bool]) -> None:
    """SIGTERM, then SIGKILL: after ``ANSWER_WAIT`` to those that show no answer to it (``answers(proc)``: a rank in
    a driver call, or one that ignores SIGTERM, would spend the whole grace for nothing), after ``grace`` seconds to
    the others still running; returns once they are gone, or ``EXIT_WAIT`` after the last SIGKILL."""
    _signal(procs, signal.SIGTERM)
    if wait_gone(procs, min(grace, ANSWER_WAIT)):
        return
    _signal([proc for proc in procs if proc.poll() is None and not answers(proc)], signal.SIGKILL)
    if not wait_gone(procs, max(grace - ANSWER_WAIT, 0.0)):
        _signal([proc for proc in procs if proc.poll() is None], signal.SIGKILL)
        wait_gone(procs, EXIT_WAIT)


def answering(directory: str, ranks: Mapping[int, int]) -> Callable[[Any], bool]:
    """Whether a process (``ranks``: its pid -> its rank) has reported since this call: a sign of life after
    SIGTERM (the signal's watcher thread reports as it wakes, whatever the main thread is blocked in)."""
    before = {pid: _reports(directory, rank) for pid, rank in ranks.items()}
    return lambda proc: _reports(directory, ranks[proc.pid]) > before[proc.pid]


def _reports(directory: str, rank: int) -> int:
    """How many reports ``rank`` has made (-1: none readable): one more is a sign of life."""
    record = progress.read(directory, rank)
    return -1 if record is None else record.seq


def _signal(procs: list[Any], sig: int) -> None:
    for proc in procs:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _failed(worker_group: Any, context: Any) -> Any:
    """The round's result for a job stalled as a whole: its workers failed (torchrun stops them all, SIGTERM
    first: ``ttp``'s dump; then restarts them as ``--max-restarts`` allows)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    ranks = {worker.local_rank: worker.global_rank for worker in worker_group.workers}
    failures = {ranks[local]: ProcessFailure(local, pid, -signal.SIGTERM, "") for local, pid in context.pids().items()}
    return RunResult(state=WorkerState.FAILED, failures=failures)


def prepare() -> str:
    """The job's progress directory, exported to the workers this launcher starts; removed when it exits."""
    directory = owned_directory("ft_plugins-progress-")
    os.environ[PROGRESS_VAR] = directory
    return directory


def install(settings: Mapping[str, Any], adapt: Callable[[Watchdog], None] = Watchdog.install,
            launcher: str = "torchrun's agent") -> bool:
    """Called in the launcher process when ``hangs`` is on: the watchdog, fitted to the launcher by ``adapt``
    (torchrun's by default); never raises (the launcher then runs as usual)."""
    try:
        adapt(Watchdog(settings, prepare()))
    except Exception as exc:
        os.environ.pop(PROGRESS_VAR, None)
        log.warning("hangs: %s not adapted (%s: %s); hangs are not watched", launcher, type(exc).__name__, exc)
        return False
    log.info("hangs: watched by this launcher; bounds: %s", Bounds(settings).describe())
    return True
