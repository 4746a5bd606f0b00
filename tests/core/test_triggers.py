"""The dying gasp survives its process's children ending: torchrun stops a worker's whole process group, so
Megatron's data loader workers end while the survivor dumps, and torch's SIGCHLD handler raises their end
in the main thread. Run in a child interpreter: a gasp ends its process."""

from __future__ import annotations

import subprocess
import sys

from support import REPO

SCRIPT = """
import signal, subprocess, sys
from ft_plugins.steps import StepTracker
from ft_plugins.triggers import DyingGasp

def data_loader_handler(signum, frame):  # what torch's DataLoader installs in the main thread
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

signal.signal(signal.SIGCHLD, data_loader_handler)
tracker = StepTracker()
tracker.begin(2, "the state a save of step 2 needs")

def save(reason, frozen):
    subprocess.Popen([sys.executable, "-c", "pass"]).wait()  # a data loader worker ends during the dump
    print("saved", reason, frozen.completed, flush=True)

if sys.argv[1] == "gasp":
    DyingGasp(tracker, save).fire("a lost peer", 3)
else:
    save("the same save, not through the gasp", tracker.freeze(0))
"""


def run(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_a_child_ending_during_the_dump_does_not_cut_it_short() -> None:
    gasp = run("gasp")
    assert (gasp.returncode, gasp.stdout) == (3, "saved a lost peer 2\n"), gasp.stderr


def test_negative_control_the_same_save_outside_the_gasp_is_cut_short() -> None:
    bare = run("bare")
    assert bare.returncode == 1 and bare.stdout == ""
    assert "DataLoader worker (pid 1) is killed by signal" in bare.stderr
