"""The dying gasp survives its process's children ending: torchrun stops a worker's whole process group, so
Megatron's data loader workers end while the survivor dumps, and torch's SIGCHLD handler raises their end
in the main thread, whichever thread saves (the main thread on a fatal error, SIGTERM's watcher thread,
another trigger's thread with the main thread parked). Run in a child interpreter: a gasp ends its process."""

from __future__ import annotations

import signal
import subprocess
import sys


SCRIPT = """
import os, signal, subprocess, sys, threading, time
from ft_plugins.steps import StepTracker
from ft_plugins.triggers import DyingGasp

def data_loader_handler(signum, frame):  # what torch's DataLoader installs in the main thread
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

signal.signal(signal.SIGCHLD, data_loader_handler)
tracker = StepTracker()
tracker.begin(2, "the state a save of step 2 needs")
worker = subprocess.Popen(["sleep", "0.3"])  # a data loader worker: the main thread's child

def save(reason, frozen):
    worker.wait()  # it ends during the dump (the kernel tells its parent, the main thread)
    time.sleep(0.5)  # which goes on writing for a while
    print("saved", reason, frozen.completed, flush=True)

if sys.argv[1] == "gasp":
    DyingGasp(tracker, save).fire("a lost peer", 3)
elif sys.argv[1] == "sigterm":  # the watcher thread saves; the main thread is busy elsewhere meanwhile
    DyingGasp(tracker, save).watch_sigterm()
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        time.sleep(0.01)
    print("the main thread went on", flush=True)
elif sys.argv[1] == "parked":  # another thread saves; the main thread is parked at its step's end
    tracker.update(lambda: True)
    threading.Thread(target=DyingGasp(tracker, save).fire, args=("a lost peer", 3), daemon=True).start()
    while not tracker.frozen:
        time.sleep(0.01)
    tracker.end()
    print("the main thread went on", flush=True)
else:
    save("the same save, not through the gasp", tracker.freeze(0))
"""


def run(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60)


def test_a_child_ending_during_the_dump_does_not_cut_it_short() -> None:
    gasp = run("gasp")
    assert (gasp.returncode, gasp.stdout) == (3, "saved a lost peer 2\n"), gasp.stderr


def test_sigterm_saves_from_the_watcher_thread_while_the_main_thread_runs_on() -> None:
    """The watcher thread saves: the main thread, between steps, no longer takes a child's end as an error."""
    term = run("sigterm")
    assert (term.returncode, term.stdout) == (128 + signal.SIGTERM, "saved SIGTERM 2\n"), term.stderr


def test_a_frozen_main_thread_stays_parked_when_a_signal_handler_raises_in_it() -> None:
    """Another thread saves (a lost peer, MindIO's controller): the parked main thread does not wake up."""
    parked = run("parked")
    assert (parked.returncode, parked.stdout) == (3, "saved a lost peer 3\n"), parked.stderr


def test_negative_control_the_same_save_outside_the_gasp_is_cut_short() -> None:
    bare = run("bare")
    assert bare.returncode == 1 and bare.stdout == ""
    assert "DataLoader worker (pid 1) is killed by signal" in bare.stderr


CHAINED = """
import os, signal, time
from ft_plugins.triggers import watch_signal

reader, writer = os.pipe()  # the wakeup descriptor another library (an asyncio loop) set before
os.set_blocking(writer, False)
signal.set_wakeup_fd(writer)
signal.signal(signal.SIGUSR1, lambda *_: None)
acted = []
watch_signal(signal.SIGUSR2, lambda: acted.append(True), "watcher")
os.kill(os.getpid(), signal.SIGUSR1)  # not the watched one: only the earlier descriptor cares
os.kill(os.getpid(), signal.SIGUSR2)
for _ in range(500):
    if acted:
        break
    time.sleep(0.01)
time.sleep(0.1)
os.set_blocking(reader, False)
try:
    passed_on = sorted(os.read(reader, 64))
except BlockingIOError:
    passed_on = []
print(passed_on == sorted([signal.SIGUSR1, signal.SIGUSR2]), acted, flush=True)
"""


def test_the_wakeup_descriptor_set_before_still_gets_every_signal() -> None:
    """``signal.set_wakeup_fd`` holds one descriptor: the watcher passes each signal's byte on to the one it
    replaced, the watched signal's and the others'."""
    chained = subprocess.run([sys.executable, "-c", CHAINED], capture_output=True, text=True, timeout=60)
    assert chained.stdout == "True [True]\n", chained.stdout + chained.stderr
