"""``ft_plugins.launch.scratch``: a launcher's scratch directory (hangs' progress reports, msrun's grace reports) is
removed when the launcher exits, and what a launcher ended by SIGKILL left is removed by the next launcher. Real
processes, each with the temporary directory of the test (``TMPDIR``); the negative control: a launcher killed whole
leaves its directory (no exit handler runs), and nothing else removes it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from support import PYTHON

PREFIX = "ft_plugins-progress-"
LAUNCHER = """import sys, time
from ft_plugins.launch.scratch import owned_directory
print(owned_directory(sys.argv[1]), flush=True)
if sys.argv[2] == "stay":
    time.sleep(120)
"""


class Launchers:
    """Launcher stand-ins that make their scratch directory as ``ft-plugins run``'s launcher does, in ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.running: list[subprocess.Popen[str]] = []

    def start(self, prefix: str = PREFIX) -> tuple[subprocess.Popen[str], Path]:
        """One that keeps running, and its directory (named ``prefix...``)."""
        process = subprocess.Popen([PYTHON, "-c", LAUNCHER, prefix, "stay"], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "TMPDIR": str(self.tmp)})
        self.running.append(process)
        return process, Path(process.stdout.readline().strip())  # type: ignore[union-attr]

    def one_through(self) -> Path:
        """One that makes its directory and exits as a launcher does at the end of its job: its directory."""
        done = subprocess.run([PYTHON, "-c", LAUNCHER, PREFIX, "end"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TMPDIR": str(self.tmp)})
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip())


@pytest.fixture
def launchers(tmp_path: Path) -> Iterator[Launchers]:
    made = Launchers(tmp_path)
    yield made
    for process in made.running:
        process.kill()
        process.wait()


def test_a_launcher_killed_whole_leaves_its_directory_and_the_next_launcher_removes_it(launchers: Launchers) -> None:
    killed, directory = launchers.start()
    assert directory.parent == launchers.tmp and directory.name.startswith(PREFIX)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert directory.is_dir(), "SIGKILL runs no exit handler: the directory stays"  # the negative control
    own = launchers.one_through()
    assert not directory.exists(), "the next launcher removes what the killed one left"
    assert not own.exists(), "a launcher's own directory is removed at its exit"
    assert not list(launchers.tmp.iterdir())


def test_a_running_launchers_directory_is_kept(launchers: Launchers) -> None:
    _, running = launchers.start()
    launchers.one_through()
    assert running.is_dir() and (running / ".owner").read_text().isdigit()


def test_a_directory_whose_owner_has_not_written_its_pid_or_not_ours_is_kept(launchers: Launchers) -> None:
    unwritten = launchers.tmp / f"{PREFIX}unwritten"
    unwritten.mkdir()
    (unwritten / ".owner").write_text("")  # made, not locked yet: its launcher is about to lock it
    foreign = launchers.tmp / f"{PREFIX}foreign"
    foreign.mkdir()  # no owner file: another program's, or an older release's
    killed, other_kind = launchers.start("ft_plugins-grace-")
    killed.kill()
    killed.wait()
    launchers.one_through()
    assert unwritten.is_dir() and foreign.is_dir()
    assert other_kind.is_dir(), "a launcher removes the directories of its own kind only"
