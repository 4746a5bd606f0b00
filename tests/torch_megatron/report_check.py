"""``ft-plugins report`` on a real job's save directory, checked against the job's own output: every fault named
with its rank, kind and how it was met, no step lost, and its time from the fault to training again as measured
from outside: Megatron's iteration lines carry their time, so from the line of the last step completed before the
fault to the line of the next step, less one step (the fastest interval between two lines)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from datetime import datetime

from support import assert_agrees
from ttp_runs import Job

LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration +(\d+)/")


def report(job: Job) -> dict:
    result = subprocess.run([sys.executable, "-m", "ft_plugins.cli", "report", str(job.save), "--json"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def measured(job: Job, completed: int) -> float:
    """Seconds from the fault in the step after ``completed`` steps to training again, from the iteration lines: the
    next step's line (the last one logged: after a restart) or, when that step is never logged (its state came from a
    dump), the first step logged after it."""
    times: dict[int, list[float]] = {}
    for stamp, step in LINE.findall(job.output):
        times.setdefault(int(step), []).append(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp())
    step = min(times[n + 1][0] - times[n][-1] for n in times if n + 1 in times and times[n + 1][0] > times[n][-1])
    return times[min(n for n in times if n > completed)][-1] - times[completed][0] - step


def check_faults(job: Job, expected: list[tuple[int, str, str, int]]) -> None:
    """``expected``: (rank, kind, how met, steps completed before the fault) of each fault, in order."""
    found = report(job)
    assert [(fault["rank"], fault["kind"], fault["how"]) for fault in found["faults"]] == [
        (rank, kind, how) for rank, kind, how, _ in expected], found
    assert [fault["steps_lost"] for fault in found["faults"]] == [0] * len(expected)
    for fault, (*_, completed) in zip(found["faults"], expected):
        assert_agrees(fault["to_training"], measured(job, completed), fault)
    assert 0 < found["goodput_percent"] < 100
    interval = found["interval"]  # every fault was met keeping every step: the optimum is the lower bound
    if job.lines("successfully saved checkpoint"):
        assert interval["at_least"] and interval["faults"] == 0 and interval["saves"] >= 1, interval
        assert 0 < interval["save_cost"] < found["wall"], interval
        young = math.sqrt(2 * interval["save_cost"] * interval["between_faults"])
        assert math.isclose(interval["optimum"], young), interval
    else:
        assert interval is None, interval
