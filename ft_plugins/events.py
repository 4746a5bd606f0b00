"""What happened in a job, when, written by every process for ``ft-plugins report``: one JSON object a line.

Each process appends to a file of its own (``<host>-<pid>-<role>.jsonl``; a process forked or turned into another
rank gets a new one), so no two writers share a file, in ``FT_PLUGINS_EVENTS_DIR`` or, by default,
``<save>/ft_events`` (Megatron's ``--save``, or a Hugging Face script's ``--output_dir``, on the command line;
MindSpore's checkpoint folder, once its glue knows it); with none, or with ``FT_PLUGINS=none``, nothing is written.
The first line names the job (``FT_PLUGINS_EVENTS_JOB``, else torchrun's ``--rdzv-id``, else the ``ft-plugins run``
launcher's pid), the role, the rank, the launcher (its parent), the restart attempt and the replacement's life, so
two jobs in one folder are told apart, and a job launched again is told from its restart attempts.

A rare event (a fault, a save, a recovery phase) is written at once: the process may be killed the next moment.
Steps are kept in memory and written every :data:`FLUSH_EVERY` seconds by a writer thread of the process's own, so a
slow file system never holds a training step (a step costs a clock read and a deque append), and by the caller at
exit and before :func:`ft_plugins.logs.exit_now`. Never raises into training.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, Mapping, Sequence

from ft_plugins.config import EVENTS_JOB_VAR, EVENTS_VAR, RECOVERY_VAR, RESTART_VAR, SELECT_VAR
from ft_plugins.rank import env_rank

FOLDER = "ft_events"
FLUSH_EVERY = 5.0  # seconds between writes of the steps kept in memory
OFF = ("off", "none")  # FT_PLUGINS_EVENTS_DIR values that turn the events off


def directory(env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """Where this job's events go: ``FT_PLUGINS_EVENTS_DIR``, else ``<--save>/ft_events`` (Megatron), else
    ``<--output_dir>/ft_events`` (Hugging Face scripts); None: nowhere, as under ``FT_PLUGINS=none`` (ft_plugins
    writes nothing then)."""
    if env.get(SELECT_VAR, "").strip().lower() == "none":
        return None
    chosen = env.get(EVENTS_VAR, "").strip()
    if chosen:
        return None if chosen.lower() in OFF else chosen
    save = option(argv, "--save") or option(argv, "--output_dir", "--output-dir")
    return os.path.join(save, FOLDER) if save else None


def size_on_disk(path: str) -> int | None:
    """The bytes a save left at ``path``: the file's, or every file's under the folder; None when unreadable."""
    try:
        if not os.path.isdir(path):
            return os.path.getsize(path)
        return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)
    except OSError:
        return None


def process_started() -> float:
    """When this process started (``time.time()`` scale), for a record begun late (MindSpore knows where its
    checkpoints go only once training begins); now where ``/proc`` does not tell."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def option(argv: Sequence[str], *names: str) -> str | None:
    """The value of an option (``--name V`` or ``--name=V``) spelled any of ``names`` on a command line, the last one
    given, as argparse takes it."""
    found = None
    for index, arg in enumerate(argv):
        if arg in names and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--") and "=" in arg and arg.split("=", 1)[0] in names:
            found = arg.split("=", 1)[1]
    return found


def job_id(argv: Sequence[str]) -> str:
    """The job's name on every node, for the launcher to give its workers (``FT_PLUGINS_EVENTS_JOB``): torchrun's
    ``--rdzv-id`` when given, else this (launching) process's id. Without it a worker takes torchrun's run id, else
    its parent's id."""
    rdzv = option(argv, "--rdzv-id", "--rdzv_id")
    return rdzv if rdzv and rdzv != "none" else f"pid{os.getpid()}"


def exit_kind(code: int) -> str:
    """What a worker's exit code says happened to it: ``signal`` (ended by SIGTERM / SIGINT / SIGHUP, or the
    dying gasp's exit after one), ``exception`` (the dying gasp's exit after its own error), else ``death``."""
    return "signal" if code in (-1, -2, -15, 129, 130, 143) else "exception" if code == 1 else "death"


class Recorder:
    """One process's events file."""

    def __init__(self, folder: str, role: str, env: Mapping[str, str], since: float | None = None) -> None:
        os.makedirs(folder, exist_ok=True)
        self.pid, self.rank = os.getpid(), None if role == "launcher" else env_rank(env)
        self.path = os.path.join(folder, f"{socket.gethostname()}-{self.pid}-{role}.jsonl")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.steps: deque[tuple[int, float, float]] = deque()  # (step, start, end): made into lines when written
        self.flushed = time.time()
        self.writing = threading.Lock()  # one writer of the steps at a time: the thread, or a flush at exit
        self.wake = threading.Event()
        self.writer: threading.Thread | None = None  # started at the first batch
        generation, _, life = env.get(RECOVERY_VAR, "").partition(",")
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        job = env.get(EVENTS_JOB_VAR) or (run_id if run_id != "none" else f"pid{os.getppid()}")
        os.environ.setdefault(EVENTS_JOB_VAR, job)  # what this process forks or starts belongs to the same job
        self.emit("start", {"job": job, **({"t": round(since, 4)} if since is not None else {}),
                            "role": role, "rank": self.rank, "pid": self.pid, "parent": os.getppid(),
                            "host": socket.gethostname(),
                            "attempt": int(env.get(RESTART_VAR, "0") or 0), "generation": int(generation or 0),
                            "life": int(life or 0)})

    def emit(self, kind: str, fields: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps({"t": round(time.time(), 4), "ev": kind, **fields}) + "\n").encode())

    def step(self, step: int, started: float) -> None:
        now = time.time()
        self.steps.append((step, started, now))
        if now - self.flushed > FLUSH_EVERY:
            self.flushed = now
            if self.writer is None:
                self.writer = threading.Thread(target=self._write_batches, name="ft_plugins-events", daemon=True)
                self.writer.start()
            self.wake.set()

    def _write_batches(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            try:
                self.flush()
            except OSError:
                pass  # an unwritable folder: the job trains on without its record

    def close(self) -> None:
        """No more writes: in this process after the batch its writer thread may be writing, so that a descriptor
        number opened again later (another file) never gets one of its batches; in a forked copy (no writer thread
        there, and the lock maybe held by the parent's at the fork) at once."""
        if self.pid == os.getpid():
            with self.writing:
                os.close(self.fd)
                self.fd = -1  # a batch woken later fails on it (EBADF), and is dropped
        else:
            os.close(self.fd)

    def flush(self) -> None:
        """Write the steps kept; after a batch the writer thread is writing (at most one write's wait)."""
        with self.writing:
            lines = [self.steps.popleft() for _ in range(len(self.steps))]
            if lines and self.fd >= 0:
                os.write(self.fd, "".join(f'{{"t": {started:.4f}, "ev": "step", "step": {step}, "end": {end:.4f}}}\n'
                                          for step, started, end in lines).encode())


_recorder: Recorder | None = None
_role = "worker"
_forked = False  # this process is a forked copy that has not begun its own events yet (its parent's writer is not here)


def _after_fork() -> None:
    global _forked
    _forked = _recorder is not None


os.register_at_fork(after_in_child=_after_fork)


def start(role: str, beside: str | None = None, since: float | None = None) -> None:
    """Begin this process's events (once; again in a process that became another rank or a forked copy);
    ``beside``: the job's checkpoint folder, for ``<beside>/ft_events`` where neither the environment nor the
    command line names a folder; ``since``: when the process started, for a record begun late."""
    global _recorder, _role
    _role = role
    argv = getattr(sys, "orig_argv", sys.argv)
    if role == "launcher":  # the workers it starts inherit the job's name
        os.environ.setdefault(EVENTS_JOB_VAR, job_id(argv))
    if _recorder is not None and _recorder.pid == os.getpid() and (role == "launcher" or _recorder.rank == env_rank()):
        return
    if _recorder is not None:  # a forked copy's, or the rank's this process was before: its own file from here
        _recorder.close()
    folder = directory(os.environ, argv)
    if folder is None and beside and not os.environ.get(EVENTS_VAR, "").strip() and \
            os.environ.get(SELECT_VAR, "").strip().lower() != "none":
        folder = os.path.join(beside, FOLDER)
    try:
        _recorder = Recorder(folder, role, os.environ, since) if folder else None
    except (OSError, ValueError):
        _recorder = None  # an unwritable folder: the job trains without its record


def recording() -> bool:
    """Whether this process keeps events (the framework glue hooks nothing for them otherwise)."""
    return _recorder is not None


def emit(event: str, /, **fields: Any) -> None:
    """Record ``event`` now, with ``fields``; nothing where no events are kept."""
    if _recorder is None:
        return
    try:
        if _recorder.pid != os.getpid():
            start(_role)
        if _recorder is not None:
            _recorder.emit(event, fields)
    except (OSError, TypeError, ValueError):
        pass


def step(number: int, started: float) -> None:
    """Step ``number`` began at ``started`` (``time.time()``) and ends now: kept, written with the next batch."""
    global _forked
    if _forked:
        _forked = False
        start(_role)
    if _recorder is not None:
        _recorder.step(number, started)


def flush() -> None:
    """Write the steps kept in memory (at exit, before ``os._exit``)."""
    if _recorder is not None and _recorder.pid == os.getpid():
        try:
            _recorder.flush()
        except OSError:
            pass


def end(code: int | None = None) -> None:
    """The process ends (``code`` when known): its last steps and the end written."""
    flush()
    if _recorder is not None and _recorder.pid == os.getpid():
        emit("end", code=code)


atexit.register(end)
