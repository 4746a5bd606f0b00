"""What the GPU checks share: the stuck kernel's length, the timing of a job's output, the abort's line."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time

STUCK = 240  # seconds the stuck kernel runs
AFTER_ABORT = 10  # seconds from the abort's return within which the side stream's dump commits (0.05 s on an H200)
MARGIN = 30  # seconds the negative control is watched beyond the side stream's dump (the kernel still runs then)
ABORTED = re.compile(r"aborted this rank's \d+ communicators? \(.*\) in ([\d.]+) s")


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
