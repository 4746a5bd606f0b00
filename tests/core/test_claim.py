"""One writer per file (``ft_plugins.checkpoint.claim``), with real processes: a claim held by a process SIGKILLed
while holding it passes to exactly one of the processes racing for it; one held by a running process does not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from ft_plugins.checkpoint.claim import release, take
from ft_plugins.processes import namespace
from support import claim_holder

RACE = ("import sys, time\nfrom ft_plugins.checkpoint.claim import take\n"  # held until every racer has tried
        "time.sleep(float(sys.argv[2]) - time.time())\nprint(take(sys.argv[1]))\n"
        "time.sleep(float(sys.argv[2]) + 3 - time.time())\n")


def _killed_holding(claim: Path) -> None:
    process = claim_holder(claim)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_claim_held_by_a_running_process_is_not_taken(tmp_path: Path) -> None:
    claim = tmp_path / ".claim-file"
    holder = claim_holder(claim)
    try:
        assert take(str(claim)) is None
    finally:
        holder.kill()
        holder.wait()
    assert claim.read_text() == f"{holder.pid} {namespace()}"


def test_a_claim_taken_on_another_host_is_not_judged_by_this_hosts_processes(tmp_path: Path) -> None:
    """On shared storage the holder may run on another node (or in another container): its pid names nothing
    here, so a pid that is not running here, or one that is, says nothing of it. It keeps its claim; one taken
    here by a process gone, or written before claims said where, passes on."""
    claim = tmp_path / ".claim-file"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    claim.write_text(f"{gone} another-boot/pid:[4026531836]")
    assert take(str(claim)) is None
    claim.write_text(f"{gone} {namespace()}")
    assert take(str(claim)) == 1
    release(str(claim), 1)
    claim.write_text(gone)
    assert take(str(claim)) == 1


def test_a_claim_of_a_process_killed_holding_it_goes_to_one_of_the_racers_only(tmp_path: Path) -> None:
    claim = tmp_path / ".claim-file"
    _killed_holding(claim)
    start = time.time() + 1.0  # every racer started and waiting, then all at once
    racers = [subprocess.Popen([sys.executable, "-c", RACE, str(claim), str(start)], stdout=subprocess.PIPE,
                               text=True) for _ in range(4)]
    answers = sorted(racer.communicate(timeout=60)[0].strip() for racer in racers)
    assert answers == ["1", "None", "None", "None"], answers
    assert sorted(path.name for path in tmp_path.iterdir()) == [".claim-file", ".claim-file.1"]  # no pid file left
    release(str(claim), 1)
    assert list(tmp_path.iterdir()) == [], "the generation taken and the one passed over, both released"


def test_generations_follow_each_holder_gone(tmp_path: Path) -> None:
    claim = tmp_path / ".claim-file"
    _killed_holding(claim)
    assert take(str(claim)) == 1  # this process holds generation 1 now: a third process cannot take it
    assert subprocess.run([sys.executable, "-c", "import sys\nfrom ft_plugins.checkpoint.claim import take\n"
                           "print(take(sys.argv[1]))", str(claim)], capture_output=True, text=True,
                          check=True).stdout.strip() == "None"
