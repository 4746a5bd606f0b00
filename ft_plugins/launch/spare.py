"""Warm spares of ``recover`` (``FT_PLUGINS_RECOVER_SPARES=N``): processes with the interpreter up and torch
and megatron imported, waiting to take over a lost rank.

    python -u -m ft_plugins.launch.spare N SCRIPT ARGS...
    python -u -m ft_plugins.launch.spare N -m MODULE ARGS...

The launcher (:mod:`ft_plugins.launch.recover`) starts one such process per node, the template, with a
worker's environment and command, and a socket as its standard input: the launcher's requests come in on
it and the template's answers go out on it, so that nothing the imports (or anything else) print on the
standard output ever reads as an answer. Once imported, the template forks ``N`` spares and answers
``ready``. Each request is one line of JSON, ``{"env": ..., "stdout": PATH, "stderr": PATH}``: a lost worker's
environment and where torchrun has its output go ("": the console). The oldest waiting spare takes it (its
output appended to those files, ft_plugins turned on again with that environment, ``SCRIPT`` or ``MODULE``
run as ``python -u`` runs it for the lost worker; each spare has a process group of its own) and the
template answers ``took PID``, then forks a spare in its place. A fork of the imported template costs ~10 ms;
starting a spare anew cost 2-3 CPU seconds of imports, taken from the ranks training on the same cores. A
taken spare is the template's child, not the launcher's: the template reports its end as ``exit PID CODE``,
woken by a pidfd where the kernel has them (Linux 5.3), else looking every :data:`POLL` seconds (Linux 4.19 and
older); either way by its pid, which no other process can take while the template has not collected it.
End of input, or the template killed: the waiting spares exit. A command torchrun runs without Python
(``--no-python``) gets no spares. A device the imports started (CUDA, an NPU) would be unusable in a fork: the
template then forks nothing, answers ``off`` and why, and exits; the launcher starts fresh processes instead.

What the imports made is moved out of the collector's reach (``gc.freeze``) before the forks: the
400,000 objects of torch and megatron stay for the process's life, every full collection of a take-over
(megatron's argument parsing triggers them) read them all (0.2 s each), and a collection in a spare
would write to every page it shares with the template.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import sys
from typing import Any, Iterator

READY, TOOK, EXIT, OFF = "ready", "took", "exit", "off"  # the template's answers
PRELOADED = ("torch", "torch.distributed", "megatron.training")
CHANNEL = 0  # standard input: a socket, the launcher's requests in, the answers out
POLL = 0.1  # seconds between looks at the taken spares where the kernel gives no pidfd


class Lines:
    """Whole lines from a pipe, read as its bytes come (after ``select`` said some did): a request or an answer
    may arrive in pieces, or several in one read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = b""

    def read(self) -> list[bytes] | None:
        """The lines one read completed (without their newline); None at end of input."""
        try:
            chunk = os.read(self.fd, 65536)
        except ConnectionResetError:  # the other side ended with some of what it was sent unread: an end too
            return None
        if not chunk:
            return None
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        return lines


class Template:
    """The forking side: ``count`` spares kept waiting, each taking the next request read."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.waiting: list[tuple[int, int]] = []  # (pid, write end of the pipe it reads its request from)
        self.taken: dict[int, int | None] = {}  # pid of a spare that took over a rank -> its pidfd (None: polled)

    def serve(self) -> dict[str, Any] | None:
        """Runs until end of input and the end of every taken spare (returns None); in a spare that took
        over, returns the request it took."""
        if (request := self._refill()) is not None:
            return request
        _say(READY)
        for line in self._requests():
            while True:  # a spare that died waiting (its pipe broken) is passed over
                pid, pipe = self.waiting.pop(0)
                try:
                    os.write(pipe, line)
                    break
                except BrokenPipeError:
                    os.waitpid(pid, 0)
                    if (request := self._refill()) is not None:
                        return request
                finally:
                    os.close(pipe)
            self.taken[pid] = _pidfd(pid)  # never raises: the spare runs as the rank now, the launcher must know
            _say(f"{TOOK} {pid}")
            if (request := self._refill()) is not None:
                return request
        return None

    def _requests(self) -> Iterator[bytes]:
        """The launcher's requests; meanwhile each taken spare's end is reported. At end of input the waiting
        spares are stopped; it returns once no taken one is left."""
        requests, reading = Lines(CHANNEL), True
        while reading or self.taken:
            pidfds = [fd for fd in self.taken.values() if fd is not None]
            polled = None in self.taken.values()
            ready = select.select([*pidfds, *([CHANNEL] if reading else [])], [], [], POLL if polled else None)[0]
            for pid in [pid for pid in self.taken if _ended(pid)]:
                self._report_end(pid)
            if CHANNEL not in ready:
                continue
            lines = requests.read()
            if lines is None:
                reading = False
                for pid, pipe in self.waiting:
                    os.kill(pid, signal.SIGKILL)
                    os.close(pipe)
                    os.waitpid(pid, 0)
                self.waiting.clear()
            for line in lines or ():
                yield line + b"\n"

    def _report_end(self, pid: int) -> None:
        """Say a taken spare's exit code, then collect it: killed in between, the template leaves a zombie its
        launcher adopts and waits for, never a spare whose end nobody can tell."""
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        killed = ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        pidfd = self.taken.pop(pid)
        _say(f"{EXIT} {pid} {-ended.si_status if killed else ended.si_status}")
        os.waitid(os.P_PID, pid, os.WEXITED)
        if pidfd is not None:
            os.close(pidfd)

    def _refill(self) -> dict[str, Any] | None:
        while len(self.waiting) < self.count:
            if (request := self._fork()) is not None:
                return request
        return None

    def _fork(self) -> dict[str, Any] | None:
        """Fork a waiting spare (None in the template); in it, block until a request comes."""
        readable, writable = os.pipe()
        pid = os.fork()
        if pid:
            os.close(readable)
            _own_group(pid)  # here too, so that it is so before the launcher learns the pid
            self.waiting.append((pid, writable))
            return None
        _own_group(0)
        os.close(writable)
        for fd in (*(fd for fd in self.taken.values() if fd is not None), *(pipe for _, pipe in self.waiting)):
            os.close(fd)  # the template's: a spare holding another's pipe would keep it from seeing the end
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, CHANNEL)  # the launcher's channel is the template's alone
        os.close(devnull)
        with os.fdopen(readable, "rb") as pipe:
            line = pipe.readline()
        if not line:
            os._exit(0)  # the template ended: nothing to take over
        return json.loads(line)


def _say(line: str) -> None:
    """One answer to the launcher."""
    try:
        os.write(CHANNEL, f"{line}\n".encode())
    except BrokenPipeError:  # the launcher is gone: its workers end with it
        pass


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` ends, or None where the kernel has no pidfd_open (before
    Linux 5.3) or refuses one: the spare's end is then looked for every :data:`POLL` seconds."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _ended(pid: int) -> bool:
    """Whether the template's child ``pid`` has ended (it stays collectable: ``WNOWAIT``)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def device_started() -> str:
    """What in this process started a device ("" when none did): a process forked after CUDA or an NPU started
    cannot use it. Asks only the frameworks already imported, and imports none."""
    for module, device, what in (("torch", "cuda", "CUDA"), ("torch_npu", "npu", "an NPU")):
        initialized = getattr(getattr(sys.modules.get(module), device, None), "is_initialized", None)
        if initialized is not None and initialized():
            return f"{what} ({module}.{device}.is_initialized())"
    return ""


def _own_group(pid: int) -> None:
    """A process group of its own for a spare, which torchrun signals whole (``killpg``) as it does a worker it
    started in a session of its own."""
    try:
        os.setpgid(pid, 0)
    except ProcessLookupError:  # it died already: the template learns so when it hands it a request
        pass


def take_over(request: dict[str, Any], command: list[str]) -> None:
    """Become the lost worker: its output, its environment, ft_plugins' hooks configured by it, its command."""
    _append_output(request["stdout"], request["stderr"])
    os.environ.update(request["env"])
    glue = sys.modules.get("ft_plugins.torch")
    if glue is not None:
        glue.enable()  # the lost worker's configuration and place in the recovery; its lines name that rank
    _run_as_main(command)


def _append_output(stdout: str, stderr: str) -> None:
    """Standard output and error to the rank's log files where torchrun has them (``--redirects``, ``--tee``),
    after what the lost worker wrote there, as a fresh replacement's go; "" leaves the console."""
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path:
            opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(opened, fd)
            os.close(opened)


def _run_as_main(command: list[str]) -> None:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``python`` runs it: as ``__main__``, ``sys.argv[0]`` its
    file, the path's first entry the working folder or the script's (its siblings import as they would)."""
    if command[0] == "-m":
        sys.argv, sys.path[0] = command[1:], os.getcwd()  # run_module puts the module's file in sys.argv[0]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        return
    sys.argv, sys.path[0] = command, os.path.dirname(os.path.realpath(command[0]))
    runpy.run_path(command[0], run_name="__main__")


def main() -> None:
    logging.disable(logging.WARNING)  # nobody's rank yet: ft_plugins' start-up lines are the taken rank's to say
    try:
        for module in PRELOADED:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    finally:
        logging.disable(logging.NOTSET)
    gc.freeze()  # what the imports made lives as long as the process: no collection reads it again
    started = device_started()
    if started:  # a fork now would hand each spare a device context it cannot use
        _say(f"{OFF} the spare template's imports ({', '.join(PRELOADED)} and what they load) started {started} "
             "before its forks, and a forked process cannot use that device; move that device call out of import "
             "time (a sitecustomize, a module-level .cuda() or set_device), or set FT_PLUGINS_RECOVER_SPARES=0")
        return
    request = Template(int(sys.argv[1])).serve()
    if request is not None:
        take_over(request, sys.argv[2:])


if __name__ == "__main__":
    main()
