"""A fresh process replacing a lost worker writes to the rank's torchrun log files (``--log-dir`` with
``--redirects`` / ``--tee``) after what the lost worker wrote there, its traceback first of all."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from ft_plugins.launch.recover import Supervisor

SAYS = "import sys; print('replacement out'); print('replacement err', file=sys.stderr)"


def test_a_fresh_replacement_appends_to_the_lost_workers_log_files(tmp_path: Path) -> None:
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    stdout.write_text("lost worker out\n")
    stderr.write_text("Traceback (most recent call last):\n  lost worker's error\n")
    context = SimpleNamespace(entrypoint=sys.executable, args={1: ("-u", "-c", SAYS)}, stdouts={1: str(stdout)},
                              stderrs={1: str(stderr)})
    handler = Supervisor._start(context, 1, {"RANK": "1"})
    try:
        assert handler.proc.wait(timeout=60) == 0
    finally:
        for stream in (handler._stdout, handler._stderr):
            stream.close()
    assert stdout.read_text() == "lost worker out\nreplacement out\n"
    assert stderr.read_text().startswith("Traceback (most recent call last):\n  lost worker's error\nreplacement err")


def test_a_fresh_replacement_without_log_files_writes_where_torchrun_does(tmp_path: Path) -> None:
    context = SimpleNamespace(entrypoint=sys.executable, args={1: ("-u", "-c", SAYS)}, stdouts={1: ""},
                              stderrs={1: ""})
    handler = Supervisor._start(context, 1, {"RANK": "1"})
    assert handler.proc.wait(timeout=60) == 0
    assert handler._stdout is None and handler._stderr is None and list(tmp_path.iterdir()) == []
