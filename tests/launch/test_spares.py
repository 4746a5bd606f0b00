"""Warm spares: when the launcher starts their template (never while a recovery is under way: its imports would
take the CPU from the replacement's set-up), and the template itself, without torch's imports (``PRELOADED``
emptied): it forks its spares, hands each request to one (which runs the script as the lost worker, in a
session of its own, with what the imports made frozen), forks another in its place and reports each taken
one's end; the launcher's handle of a forked worker learns that end as torchrun asks for it."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ft_plugins.launch.process import reap_adopted
from ft_plugins.launch.recover import Supervisor
from ft_plugins.launch.spares import Spares
from ft_plugins.processes import status
from ft_plugins.recovery import key

PR_SET_CHILD_SUBREAPER = 36

WORKER = """import gc, json, os, sys, time
print(json.dumps({"frozen": gc.get_freeze_count(), "rank": os.environ["RANK"], "argv": sys.argv, "pid": os.getpid(),
                  "group": os.getpgid(0), "stdin": sys.stdin.read(), "name": __name__, "path0": sys.path[0]}),
      flush=True)
time.sleep(float(os.environ.get("HOLD", "0")))
sys.exit(int(os.environ.get("CODE", "0")))
"""
# the template as the launcher starts it (`ENTRYPOINT -u -m ft_plugins.launch.spare N SCRIPT ARGS`), torch not imported
# (and whatever $PRELOAD names)
TEMPLATE = ("import os, ft_plugins.launch.spare as spare; "
            "spare.PRELOADED = ('json', 'decimal', *os.environ.get('PRELOAD', '').split()); spare.main()")
# an import that prints on standard output, as some do while they load
NOISY = """import os, sys
print()
print("took 1")
sys.stdout.flush()
os.write(1, b"\\xff\\n\\nexit 1 0\\nready\\n")
"""


class Store:
    """torchrun's store as the supervisor uses it: ``add(key, 0)`` reads a counter."""

    def __init__(self, **counters: int) -> None:
        self.counters = counters
        self.fails = False
        self.calls = 0

    def add(self, name: str, amount: int) -> int:
        self.calls += 1
        if self.fails:
            raise ConnectionError("store host gone")
        self.counters[name] = self.counters.get(name, 0) + amount
        return self.counters[name]


class CountingSpares:
    def __init__(self) -> None:
        self.refills = 0

    def refill(self, context: Any) -> None:
        self.refills += 1

    def stop(self) -> None:
        pass

    def reap(self) -> None:
        pass


def _round(supervisor: Supervisor) -> int:
    """One monitoring round of a healthy 4-worker group; the refills it made."""
    worker = SimpleNamespace(world_size=4, id=None)
    group = SimpleNamespace(workers=[worker] * 4, spec=SimpleNamespace(max_restarts=3))
    context = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))},
                              _running_local_ranks={0}, pids=lambda: {0: 1})
    before = supervisor.spares.refills
    supervisor.monitor(lambda *a, **k: SimpleNamespace(state=SimpleNamespace(name="HEALTHY")),
                       SimpleNamespace(_pcontext=context, _remaining_restarts=3), (group,), {})
    return supervisor.spares.refills - before


def test_a_spare_is_started_only_once_the_recovery_is_done() -> None:
    supervisor = Supervisor()
    supervisor.spares = CountingSpares()  # type: ignore[assignment]
    assert _round(supervisor) == 1  # no recovery yet
    supervisor.generation, supervisor.store = 1, Store(**{key(1, "done"): 3})
    assert _round(supervisor) == 0  # 3 of 4 ranks repaired: the replacement is still setting up
    supervisor.store.counters[key(1, "done")] = 4
    assert _round(supervisor) == 1
    calls = supervisor.store.calls
    assert _round(supervisor) == 1 and supervisor.store.calls == calls  # a settled generation is not asked again
    supervisor.generation = 2
    supervisor.store.fails = True  # the store host gone: the next failure says so; the spare costs nothing
    assert _round(supervisor) == 1



@pytest.fixture
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def _answer(answers: Any) -> list[str]:
    return answers.readline().decode().split()


def test_the_template_hands_each_request_to_a_forked_spare_and_reports_its_end(worker: Path) -> None:
    ours, theirs = socket.socketpair()  # the template's standard input, as the launcher gives it
    with theirs:
        template = subprocess.Popen([sys.executable, "-c", TEMPLATE, "2", str(worker), "--x"], stdin=theirs,
                                    stdout=subprocess.PIPE)
    answers = ours.makefile("rb")
    try:
        assert _answer(answers) == ["ready"]
        pids = []
        for rank, code in (("3", "0"), ("1", "7")):
            request = {"env": {"RANK": rank, "CODE": code}, "stdout": "", "stderr": ""}  # output: the console
            ours.sendall(json.dumps(request).encode() + b"\n")
            word, pid = _answer(answers)
            assert word == "took"
            assert _answer(answers) == ["exit", pid, code]
            pids.append(int(pid))
        ours.shutdown(socket.SHUT_WR)  # the launcher stopped: the waiting spares go, the template ends
        assert template.wait(timeout=30) == 0
        printed = template.stdout.read().decode()
    finally:
        template.kill()
        ours.close()
    seen = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [one["rank"] for one in seen] == ["3", "1"] and [one["pid"] for one in seen] == pids
    for one in seen:
        assert one["argv"] == [str(worker), "--x"] and one["stdin"] == ""  # the requests are not a worker's input
        assert one["group"] == one["pid"]  # a process group of its own, which torchrun signals whole
        assert one["frozen"] > 1000  # the interpreter's and the preloaded modules' objects
    assert _spares_of(worker) == [], "the waiting spares were stopped"


def _spares_of(worker: Path) -> list[int]:
    """Live processes running the template's command line (its spares)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if str(worker).encode() in command and state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture(autouse=True)
def python_exec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entrypoint :func:`_context` writes is the Python torchrun runs its workers with."""
    monkeypatch.setenv("PYTHON_EXEC", str(tmp_path / "python"))


@pytest.fixture(autouse=True)
def adoptions_undone() -> Any:
    """The launcher's side makes this process the subreaper of what it starts (as torchrun is): undone after
    each test, what it adopted collected."""
    yield
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    reap_adopted()


def _context(tmp_path: Path, *command: str, **env: str) -> SimpleNamespace:
    """A torchrun-like context running ``python -u COMMAND``, whose entrypoint runs the template without torch's
    imports."""
    entrypoint = tmp_path / "python"
    entrypoint.write_text(f"#!/bin/sh\nshift 3\nexec {sys.executable} -c \"{TEMPLATE}\" \"$@\"\n")
    entrypoint.chmod(0o755)
    return SimpleNamespace(entrypoint=str(entrypoint), args={0: ("-u", *command)}, envs={0: {"RANK": "0", **env}})


def _ready(spares: Spares, context: SimpleNamespace) -> Spares:
    """``spares`` with its template started from ``context``, once it said it is ready."""
    spares.refill(context)
    deadline = time.monotonic() + 60
    while not spares.ready and time.monotonic() < deadline:
        spares._read(0.1)
    assert spares.ready
    return spares


def _ready_spares(tmp_path: Path, worker: Path, **env: str) -> Spares:
    """The launcher's side (:class:`Spares`) with its template ready."""
    return _ready(Spares(1), _context(tmp_path, str(worker), **env))


@pytest.fixture
def launcher(tmp_path: Path, worker: Path) -> Any:
    spares = _ready_spares(tmp_path, worker)
    yield spares
    spares.stop()
    spares.template.wait(timeout=30)


def test_what_the_templates_imports_print_never_reaches_the_launcher(tmp_path: Path, worker: Path,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "noisy.py").write_text(NOISY)
    spares = _ready_spares(tmp_path, worker, PRELOAD="noisy", PYTHONPATH=str(tmp_path))
    try:
        taken = spares.take({"RANK": "2", "CODE": "3"}, 2)
        assert taken is not None and taken.proc.pid != 1
        assert taken.proc.wait(timeout=30) == 3
    finally:
        spares.stop()
        spares.template.wait(timeout=30)
    printed = capfd.readouterr().out
    assert "took 1" in printed and "exit 1 0" in printed, "the noise went to the console"
    assert '"rank": "2"' in printed, "and so does a spare's output, as a worker's"


def test_the_launcher_learns_a_forked_workers_end_as_torchrun_asks(launcher: Spares) -> None:
    first = launcher.take({"RANK": "2", "HOLD": "60"}, 2)
    assert first.local_rank_id == 2 and first.proc.poll() is None  # running
    with pytest.raises(subprocess.TimeoutExpired):
        first.proc.wait(timeout=0.2)
    first.close(signal.SIGTERM)  # torchrun's close: its process group
    assert first.proc.wait(timeout=30) == -signal.SIGTERM
    second = launcher.take({"RANK": "2", "CODE": "5"}, 2)  # the spare forked in the first one's place
    assert second.proc.pid != first.proc.pid
    assert second.proc.wait(timeout=30) == 5 and second.proc.poll() == 5
    launcher.stop()
    assert launcher.template.wait(timeout=30) == 0


def test_a_template_gone_leaves_its_workers_exit_codes_known_exactly(tmp_path: Path, worker: Path,
                                                                     launcher: Spares) -> None:
    clean = launcher.take({"RANK": "2", "HOLD": "2"}, 2)  # ends by itself, code 0, after its template
    killed = launcher.take({"RANK": "3", "HOLD": "60"}, 3)
    first = launcher.template
    first.kill()
    first.wait(timeout=30)
    assert clean.proc.poll() is None and killed.proc.poll() is None  # still training
    assert clean.proc.wait(timeout=30) == 0  # a clean end stays clean, the template gone or not
    _ready(launcher, _context(tmp_path, str(worker)))  # the next round's refill: a template in the first one's place
    assert launcher.template is not first
    killed.close(signal.SIGKILL)
    assert killed.proc.wait(timeout=30) == -signal.SIGKILL  # learnt although the new template knows nothing of it
    assert launcher.take({"RANK": "2", "CODE": "4"}, 2).proc.wait(timeout=30) == 4  # the new template's


def test_what_a_dead_template_leaves_is_collected(launcher: Spares, worker: Path) -> None:
    taken = launcher.take({"RANK": "2", "HOLD": "60"}, 2)
    deadline, waiting = time.monotonic() + 30, []
    while len(waiting) != 1 and time.monotonic() < deadline:  # the one forked in the taken one's place
        waiting = [pid for pid in _spares_of(worker) if pid not in (taken.proc.pid, launcher.template.pid)]
    assert len(waiting) == 1
    launcher.template.kill()
    launcher.template.wait(timeout=30)
    deadline = time.monotonic() + 30
    while status(waiting[0]) != (True, os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the waiting spare saw its template's end: exited, adopted by the launcher
    assert status(waiting[0]) == (True, os.getpid())
    launcher.reap()
    assert status(waiting[0]) is None, "collected"
    assert status(taken.proc.pid) == (False, os.getpid()), "a taken one is left to its handle"
    taken.close(signal.SIGKILL)
    assert taken.proc.wait(timeout=30) == -signal.SIGKILL


def test_a_spare_runs_a_module_as_torchrun_module_does(tmp_path: Path, worker: Path,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    spares = _ready(Spares(1), _context(tmp_path, "-m", "worker", "-u", PYTHONPATH=str(tmp_path)))
    try:
        assert spares.take({"RANK": "2", "CODE": "6"}, 2).proc.wait(timeout=30) == 6
    finally:
        spares.stop()
        spares.template.wait(timeout=30)
    seen = json.loads(next(line for line in capfd.readouterr().out.splitlines() if line.startswith("{")))
    assert seen["name"] == "__main__" and seen["argv"] == [str(worker), "-u"]  # the script's own -u stays
    assert seen["path0"] == os.getcwd()  # as `python -m` puts it


def test_a_spare_runs_a_script_with_its_folder_first_on_the_path(tmp_path: Path, worker: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    spares = _ready_spares(tmp_path, worker)
    try:
        assert spares.take({"RANK": "2"}, 2).proc.wait(timeout=30) == 0
    finally:
        spares.stop()
        spares.template.wait(timeout=30)
    seen = json.loads(next(line for line in capfd.readouterr().out.splitlines() if line.startswith("{")))
    assert seen["argv"] == [str(worker)] and seen["path0"] == str(worker.parent)  # as `python SCRIPT` puts it


def test_a_spare_writes_to_the_ranks_log_files_after_the_lost_worker(tmp_path: Path, worker: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    stdout.write_text("lost worker out\n")
    stderr.write_text("Traceback of the lost worker\n")
    spares = _ready_spares(tmp_path, worker)
    try:
        taken = spares.take({"RANK": "2", "CODE": "3"}, 2, str(stdout), str(stderr))  # torchrun --redirects 3
        assert taken.proc.wait(timeout=30) == 3
    finally:
        spares.stop()
        spares.template.wait(timeout=30)
    lost, written = stdout.read_text().splitlines()
    assert lost == "lost worker out" and json.loads(written)["pid"] == taken.proc.pid
    assert stderr.read_text() == "Traceback of the lost worker\n"
    assert '"rank"' not in capfd.readouterr().out, "nothing on the console"


def test_a_command_torchrun_runs_without_python_gets_no_spares_said_once(caplog: pytest.LogCaptureFixture) -> None:
    context = SimpleNamespace(entrypoint="/bin/bash", args={0: ("-u", "train.sh")}, envs={0: {"RANK": "0"}})
    spares = Spares(1)  # torchrun --no-python /bin/bash -u train.sh
    with caplog.at_level(logging.WARNING, logger="ft_plugins.recover"):
        spares.refill(context)
        spares.refill(context)
    assert spares.template is None and spares.take({"RANK": "1"}, 1) is None
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and "warm spares off" in said[0] and "/bin/bash" in said[0], said


def test_a_wedged_template_is_stopped_and_a_fresh_process_takes_over(launcher: Spares,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import ft_plugins.launch.spares as spares

    monkeypatch.setattr(spares, "ANSWER", 0.5)
    os.kill(launcher.template.pid, signal.SIGSTOP)  # it reads no request
    assert launcher.take({"RANK": "2"}, 2) is None
    assert launcher.template.wait(timeout=30) == -signal.SIGKILL
    assert launcher.take({"RANK": "2"}, 2) is None and launcher.ended


def test_lines_come_whole_however_the_pipe_cuts_them() -> None:
    from ft_plugins.launch.spare import Lines

    readable, writable = os.pipe()
    lines = Lines(readable)
    os.write(writable, b'{"RANK": ')
    assert lines.read() == []  # half a request: nothing yet
    os.write(writable, b'"1"}\ntook 7\nexit 7 ')
    assert lines.read() == [b'{"RANK": "1"}', b"took 7"]
    os.write(writable, b"0\n")
    assert lines.read() == [b"exit 7 0"]
    os.close(writable)
    assert lines.read() is None
    os.close(readable)
