"""Running the launched command: replaced in place (exit code and signals are then the command's own);
supervised, for a launcher that leaves its workers behind when stopped (msrun); or, with the TaskD manager
beside it, as a child whose signals are forwarded and whose exit code is returned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Collection, Mapping, Sequence

from ft_plugins.processes import all_pids, status

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MANAGER_STOP_TIMEOUT = 10.0
GRACE = 20.0  # seconds a stopped job's processes get for their dying gasp before SIGKILL
_PR_SET_CHILD_SUBREAPER = 36
_POLL = 0.1


def exec_command(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Become ``command`` (``os.execvpe``); returns only when it cannot be started (127 not found, 126 not runnable)."""
    try:
        os.execvpe(command[0], list(command), dict(env))
    except OSError as exc:
        print(f"ft-plugins run: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126  # as a shell reports it


def exit_code(returncode: int) -> int:
    """A child's ``returncode`` as a shell reports it: killed by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_beside(command: Sequence[str], env: Mapping[str, str], companion: Sequence[str],
               companion_env: Mapping[str, str], grace: Callable[[], float] | None = None) -> int:
    """Start ``companion`` (the manager), then ``command``; forward signals to ``command`` (or, with a
    ``grace``, :func:`supervise` it); when it exits, stop the companion and return the command's exit code."""
    helper = subprocess.Popen(list(companion), env=dict(companion_env))
    if grace is not None:
        try:
            return supervise(command, env, grace)
        finally:
            _stop(helper)
    try:
        child = subprocess.Popen(list(command), env=dict(env))
    except OSError as exc:
        _stop(helper)
        print(f"ft-plugins run: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    previous = {sig: signal.signal(sig, lambda signum, _frame: child.send_signal(signum)) for sig in FORWARDED}
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(helper)
    return exit_code(returncode)


def supervise(command: Sequence[str], env: Mapping[str, str], grace: Callable[[], float] = lambda: GRACE) -> int:
    """Run ``command`` so that none of its processes outlives this one; its exit code, or 128 + N when
    signal N stopped it.

    msrun starts its workers in sessions of their own and has no SIGTERM handler (SIGINT SIGKILLs the
    workers): stopped, it leaves them training. Here this process adopts whatever the command orphans
    (a child subreaper), and on SIGTERM, SIGINT or SIGHUP ends the launcher first (it would SIGKILL the
    other workers when one exits), sends SIGTERM to every process left (workers, scheduler: their dying
    gasp), and SIGKILLs those still running after ``grace()`` seconds (asked when they are stopped: a grace
    may follow what the job's writes recorded since). Processes the command leaves behind when it exits by
    itself get the same.
    """
    adopt_orphans()
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in STOPPING}
    try:
        try:
            # a session of its own: a terminal's Ctrl+C reaches this process only, not msrun's SIGINT
            # handler, which would SIGKILL the workers before their dying gasp
            child = subprocess.Popen(list(command), env=dict(env), start_new_session=True)
        except OSError as exc:
            print(f"ft-plugins run: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127
        returncode = None
        while returncode is None and not received:
            try:
                returncode = child.wait(_POLL)
            except subprocess.TimeoutExpired:
                pass
        seconds = grace()
        if received:
            print(f"ft-plugins run: {signal.Signals(received[0]).name}: stopping {command[0]} and every process "
                  f"it started (SIGTERM, SIGKILL after {seconds:g} s)", file=sys.stderr)
            child.send_signal(signal.SIGTERM)  # the launcher first: it must not SIGKILL the workers mid-gasp
            try:
                child.wait(min(seconds, 1.0))
            except subprocess.TimeoutExpired:
                pass
        _end_all(seconds, child.pid)
        if child.poll() is None:
            child.kill()
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else exit_code(returncode)


def adopt_orphans() -> bool:
    """Become the parent of the orphans of every process below this one (Linux ``PR_SET_CHILD_SUBREAPER``),
    which can then wait for them; False where that cannot be."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_adopted(keep: Collection[int] = ()) -> None:
    """Collect the exited processes this one adopted (:func:`adopt_orphans`), but those in ``keep``, which
    someone waits for. Adopted: in a session neither this process's nor its own (a child started here runs
    in one of those two), so a child whose ``Popen`` will ask for its end is never taken from it."""
    try:
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return  # no child has exited: nothing to read in /proc
    except ChildProcessError:
        return
    me, session = os.getpid(), os.getsid(0)
    for pid, parent, exited in _processes():
        if parent == me and exited and pid not in keep:
            try:
                if os.getsid(pid) not in (session, pid):
                    os.waitpid(pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError):  # collected meanwhile
                pass


def wait_gone(procs: Sequence[Any], seconds: float, poll: float = 0.05) -> bool:
    """Wait up to ``seconds`` for every process (``Popen``-like: ``poll()``) to have exited; whether they all did."""
    deadline = time.monotonic() + seconds
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def _processes() -> list[tuple[int, int, bool]]:
    """(pid, parent pid, exited) of every process."""
    return [(pid, found[1], found[0]) for pid in all_pids() if (found := status(pid)) is not None]


def descendants(root: int) -> list[int]:
    """The processes below ``root`` that have not exited."""
    children: dict[int, list[int]] = {}
    for pid, parent, exited in _processes():
        if not exited:
            children.setdefault(parent, []).append(pid)
    found, queue = [], [root]
    while queue:
        for pid in children.get(queue.pop(), ()):
            found.append(pid)
            queue.append(pid)
    return found


def _end_all(grace: float, command: int) -> None:
    """SIGTERM to every process below this one, SIGKILL to those left after ``grace``; adopted orphans reaped
    (``command``, waited for by its Popen, is not)."""
    _signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while descendants(os.getpid()) and time.monotonic() < deadline:
        _reap(command)
        time.sleep(_POLL)
    _signal_all(signal.SIGKILL)
    _reap(command)


def _signal_all(sig: int) -> None:
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(command: int) -> None:
    me = os.getpid()
    for pid, parent, exited in _processes():
        if parent == me and exited and pid != command:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(MANAGER_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
