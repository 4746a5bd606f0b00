"""msrun's stop of the other workers when one failed, under ``ft-plugins run``: SIGTERM to each worker's process
group, the run's grace, then msrun's own SIGKILL (``_ProcessManager.kill_worker_processes``, the real one, over
real processes started in sessions of their own as msrun starts its workers). The whole msrun job is in
test_msrun.py (a dump of 5 s completed under ``ft-plugins run``, cut short under plain msrun)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ft_plugins.launch import shutdown
from ft_plugins.processes import alive

# a worker that takes ``GASP`` seconds to answer SIGTERM, or ignores it, and leaves a child in its group
WORKER = """
import os, signal, subprocess, sys, time
out, answer = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(600)"])
open(os.path.join(out, f"child_{os.getpid()}"), "w").write(str(child.pid))
def gasp(*_):
    time.sleep(float(answer))
    open(os.path.join(out, f"gasped_{os.getpid()}"), "w").close()
    os._exit(143)
signal.signal(signal.SIGTERM, gasp if answer != "deaf" else signal.SIG_IGN)
open(os.path.join(out, f"ready_{os.getpid()}"), "w").close()
time.sleep(600)
"""
GASP = 0.5
GRACE = 2.0


def _workers(out: Path, answers: list[str]) -> list[subprocess.Popen]:
    script = out / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(out), answer], start_new_session=True)
             for answer in answers]
    deadline = time.monotonic() + 60
    while not all((out / f"ready_{proc.pid}").exists() for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


def test_the_others_get_the_grace_then_msruns_sigkill_reaches_the_deaf_one_and_what_each_left(tmp_path: Path) -> None:
    from mindspore.parallel.cluster.process_entity._api import _ProcessManager

    procs = _workers(tmp_path, [str(GASP), "deaf"])
    children = [int((tmp_path / f"child_{proc.pid}").read_text()) for proc in procs]
    manager = SimpleNamespace(cgn_processes=procs)
    started = time.monotonic()
    try:
        kill = _ProcessManager.kill_worker_processes  # msrun's own, as it runs it
        shutdown.Planned(GRACE, None).msrun_kill(lambda: kill(manager), manager, (), {})
        took = time.monotonic() - started
        answering, deaf = procs
        assert answering.wait(5) == 143 and (tmp_path / f"gasped_{answering.pid}").exists()  # its gasp completed
        assert deaf.wait(5) == -9 and took >= GRACE  # SIGKILLed by msrun's own kill, once the grace was over
        deadline = time.monotonic() + 5
        while any(map(alive, children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, children)), "what a worker left in its group is SIGKILLed as msrun does"
    finally:
        for pid in [*(proc.pid for proc in procs), *children]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_without_ft_plugins_run_msrun_sigkills_at_once(tmp_path: Path) -> None:
    """The negative control: msrun's own kill, as plain msrun runs it, gives the answering worker no time."""
    from mindspore.parallel.cluster.process_entity._api import _ProcessManager

    procs = _workers(tmp_path, [str(GASP)])
    _ProcessManager.kill_worker_processes(SimpleNamespace(cgn_processes=procs))
    assert procs[0].wait(5) == -9 and not (tmp_path / f"gasped_{procs[0].pid}").exists()
    os.kill(int((tmp_path / f"child_{procs[0].pid}").read_text()), 9)
