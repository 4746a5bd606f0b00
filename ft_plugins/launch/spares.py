"""Warm spares for ``recover``'s launcher side: a template process (:mod:`.spare`) forks workers ahead, torch and
megatron imported, and a lost rank is taken over by one of them (:class:`Spares`); torchrun holds it through
:class:`Forked`, as it holds a ``Popen``.

A forked worker is the template's child: the template reports its exit code. If the template dies first, the code
must still be known exactly (a clean end is not a failure; a failure is not a clean end). A worker cannot report
its own code: the faults recovery is for kill it by a signal, and ft_plugins' dying gasp leaves through
``os._exit``; only a parent learns how a process ended. So the launcher makes itself the subreaper of what it
starts (``PR_SET_CHILD_SUBREAPER``): a dead template's spares become its children, and it waits for them itself. It
then collects what else it adopts (a lost worker's children), which would stay zombies until torchrun ends.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

from ft_plugins.launch.process import adopt_orphans, reap_adopted
from ft_plugins.launch.spare import EXIT, OFF, READY, TOOK, Lines

log = logging.getLogger("ft_plugins.recover")

PLACE = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")
ANSWER = 10.0  # seconds the spare template may take to hand a request to a spare (it takes milliseconds)
WAIT_POLL = 0.05  # seconds between looks at a forked worker's end while torchrun waits for it
REAP_EVERY = 1.0  # seconds between collections of what the launcher adopted


class Spares:
    """The template of ``count`` warm spares (:mod:`ft_plugins.launch.spare`), kept started beside the local
    workers: a lost rank is taken over by a spare it forked, and it forks another in its place."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.template: Any = None  # Popen
        self.ready = False  # the template imported and forked its spares
        self.ended = False  # its output ended: it is gone
        self.took: list[int] = []  # pids it answered a request with, not yet handed out
        self.exits: dict[int, int] = {}  # pid of a taken spare -> exit code, as the template reported
        self.handed: set[int] = set()  # taken spares handed to torchrun whose end is not known yet
        self._channel: socket.socket | None = None  # the template's standard input: requests out, answers in
        self._answers: Lines | None = None
        self._next_reap = 0.0

    def refill(self, context: Any) -> None:
        """Start the template unless one runs; before the first, whether spares can be had (if not, said once)."""
        self._read(0)
        if not self.count or (self.template is not None and not self.ended):
            return
        command = _python_command(context.entrypoint, context.args[0])
        why_not = _why_no_spares(context.entrypoint, command) if self.template is None else ""
        if why_not:
            self._off(why_not)
            return
        self._channel, theirs = socket.socketpair()
        with theirs:  # a channel of its own: what the template's imports print goes to the console, never here
            self.template = subprocess.Popen([context.entrypoint, "-u", "-m", "ft_plugins.launch.spare",
                                              str(self.count), *command],
                                             env=_unplaced({**os.environ, **context.envs[0]}), stdin=theirs,
                                             start_new_session=True)
        self.ready = self.ended = False
        self.took, self._answers = [], Lines(self._channel.fileno())

    def take(self, env: dict[str, str], local_rank: int, stdout: str = "", stderr: str = "") -> Any:
        """A ready spare made into the worker of ``env`` (a handler torchrun's context can hold), or None; its
        output goes to the rank's files ``stdout`` and ``stderr`` as torchrun names them ("": the console)."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler  # install() checked

        self._read(0)
        if self.template is None or not self.ready or self.ended:
            return None  # none, still importing, or gone
        try:
            self._channel.sendall(json.dumps({"env": env, "stdout": stdout, "stderr": stderr}).encode() + b"\n")
        except OSError:
            return None
        deadline = time.monotonic() + ANSWER
        while not self.took and not self.ended and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        if not self.took:  # wedged: a late answer would name a spare for a rank a fresh process took
            log.warning("recover: the spare template did not answer within %.0f s; it is stopped, a fresh process "
                        "takes over", ANSWER)
            self.template.kill()
            return None
        handler = SubprocessHandler.__new__(SubprocessHandler)
        handler.proc, handler._stdout, handler._stderr, handler.local_rank_id = (Forked(self.took.pop(0), self), None,
                                                                                 None, local_rank)
        self.handed.add(handler.proc.pid)
        return handler

    def exit_code(self, pid: int, template: Any) -> int | None:
        """A taken spare's exit code once known: ``template`` (the one that forked it) reports it, or, gone
        before it did, left the spare to this launcher, which waits for it."""
        gone = template.poll() is not None  # first: a template gone has said all it ever will
        self._read(0)  # a later template was started only once this one's answers were all read
        code = self.exits.pop(pid, None)
        if code is None and gone:
            code = _adopted_exit(pid)
        if code is not None:
            self.handed.discard(pid)
        return code

    def reap(self) -> None:
        """Collect what this launcher adopted (a dead template's waiting spares, a lost worker's children),
        every ``REAP_EVERY`` seconds; a taken spare is left to its handle, which asks for its exit code."""
        if self.template is None or time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + REAP_EVERY
        reap_adopted(keep=self.handed)

    def stop(self) -> None:
        """End of the template's input: it stops its waiting spares and reports the taken ones until they end."""
        if self._channel is not None and not self.ended:
            try:
                self._channel.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _read(self, timeout: float) -> None:
        if self._answers is None or self.ended:
            return
        while select.select([self._answers.fd], [], [], max(timeout, 0))[0]:
            lines = self._answers.read()
            if lines is None:
                self.ended = True
                self._channel.close()
                return
            for line in lines:
                word, _, rest = line.decode().partition(" ")
                if word == READY:
                    self.ready = True
                elif word == TOOK:
                    self.took.append(int(rest))
                elif word == EXIT:
                    pid, code = rest.split()
                    self.exits[int(pid)] = int(code)
                elif word == OFF:  # it found it cannot fork usable spares, and exits
                    self._off(rest)
            timeout = 0

    def _off(self, why: str) -> None:
        """Said once: no template is started again, each lost rank gets a fresh process."""
        log.warning("recover: warm spares off for this job: %s; a lost rank is replaced by a fresh process", why)
        self.count = 0


class Forked:
    """What torchrun uses of a worker's ``Popen``, for a spare the template forked: the template's child, so
    its end is learnt from the template's report (or, the template gone, by waiting for it here)."""

    def __init__(self, pid: int, spares: Spares) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._spares = spares
        self._template = spares.template  # the one that forked it: a later one knows nothing of it

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._spares.exit_code(self.pid, self._template)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(WAIT_POLL)
        return self.returncode  # type: ignore[return-value]


def _python_command(entrypoint: str, args: Sequence[str]) -> list[str] | None:
    """What torchrun has its Python run (``SCRIPT ARGS`` or ``-m MODULE ARGS``: its command is ``PYTHON -u``
    and that), or None for a command it runs without Python (``--no-python``)."""
    if entrypoint != os.getenv("PYTHON_EXEC", sys.executable) or list(args[:1]) != ["-u"]:
        return None
    return [str(arg) for arg in args[1:]]


def _why_no_spares(entrypoint: str, command: list[str] | None) -> str:
    """Why this job cannot have warm spares ("" when it can)."""
    if command is None:
        return (f"torchrun runs the workers' command ({entrypoint}) without Python (--no-python), and a spare "
                "can stand in only for a Python script or module")
    if not adopt_orphans():
        return ("this launcher cannot become the parent of a spare whose template died (PR_SET_CHILD_SUBREAPER), "
                "so such a worker's exit code would be lost")
    return ""


def _adopted_exit(pid: int) -> int | None:
    """The exit code of a spare whose template died before it did: adopted by this launcher, which waits for
    it (None while it runs)."""
    try:
        found, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not adopted: cannot be while spares run (they need adopt_orphans); said, not raised
        log.warning("recover: pid %d outlived its spare template and is not this launcher's to wait for; its "
                    "exit code is unknown: a failure", pid)
        return 1
    return os.waitstatus_to_exitcode(status) if found else None


def _unplaced(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment without its place: a spare is nobody's until it takes over."""
    return {name: value for name, value in env.items() if name not in PLACE}
