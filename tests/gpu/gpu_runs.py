"""What the GPU checks share: the stuck kernel's length, the timing of a job's output, the abort's line."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

STUCK = 240  # seconds the stuck kernel runs
AFTER_ABORT = 10  # seconds from the abort's return within which the side stream's dump commits (0.05 s on an H200)
MARGIN = 30  # seconds the negative control is watched beyond the side stream's dump (the kernel still runs then)
ABORTED = re.compile(r"aborted this rank's \d+ communicators? \(.*\) in ([\d.]+) s")


def launch_job(port: int, *arguments: str, **env: str) -> subprocess.Popen[str]:
    """One process under torchrun (``arguments``: the script and its own), in a session of its own that
    :func:`watch_job` ends; the environment's ``FT_PLUGINS*`` left out, ``env`` added."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
               *arguments]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    return subprocess.Popen(command, env={**clean, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def aborted_seconds(output: str) -> list[float]:
    """How long each abort of the communicators took, by the dump's lines in ``output``."""
    return [float(match.group(1)) for match in map(ABORTED.search, output.splitlines()) if match]


def negative_watch(side_seen: float | None) -> float:
    """How long the negative control is watched after its fault: past the side stream's time, while the kernel
    runs."""
    return min((side_seen or 0) + MARGIN, STUCK - MARGIN)


def watch_job(process: subprocess.Popen[str], until: str, after_fault: float) -> tuple[str, float | None]:
    """The job's output until ``until`` shows (and the seconds from the fault to it), or until ``after_fault``
    seconds passed after the fault fired; then the job is ended, stuck kernel and all."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    fired = seen_after = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        waited = after_fault - (time.monotonic() - fired) if fired is not None else deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(waited, 0.01))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if fired is None and "firing injected fault" in line:
            fired = time.monotonic()
        if until in line:
            seen_after = time.monotonic() - (fired if fired is not None else time.monotonic())
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    with contextlib.suppress(queue.Empty):  # what was printed before the end
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
    return "".join(seen), seen_after
