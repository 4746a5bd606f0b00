"""The periodic save interval a job should use, from its own figures (Young's first-order optimum, which Daly refines
by terms of order C/M, negligible where saves are short against the time between faults):

    optimum = √(2 · C · M)

C: what one save cost the job (the report's save time over the number of saves), M: the mean time between the faults
that sent it back to a periodic save (those that recomputed steps: a fault met by the dying gasp or in place loses no
step, whatever the interval). An interval τ wastes C/τ of the time saving and τ/(2M) recomputing, on average; the
current interval's waste over the optimum's, times the job's wall time, is what the interval lost in this job. With no
such fault the rate is unknown: the job's wall time is then a lower bound of M, so the optimum is at least the figure
given (``at_least``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class Interval:
    save_cost: float  # seconds one save cost the job
    saves: int
    between_faults: float  # seconds between faults that recomputed steps (at_least: the wall time, none happened)
    faults: int  # faults that recomputed steps
    at_least: bool  # no such fault: the optimum is a lower bound
    optimum: float  # seconds
    optimum_steps: int | None  # the optimum in steps of the job's median step (None: no step timed)
    current: float | None  # seconds between consecutive saves of a process, median (None: fewer than two saves)
    current_steps: int | None
    lost: float | None  # seconds the current interval cost over the optimum in this job (None: unknown)


def _waste(interval: float, save_cost: float, between_faults: float) -> float:
    """The share of the time an interval wastes: saving, and recomputing half an interval per fault on average."""
    return save_cost / interval + interval / (2.0 * between_faults)


def advise(wall: float, save_time: float, saves: int, save_starts: Sequence[Sequence[dict[str, Any]]],
           step_seconds: Sequence[float], faults_recomputing: int) -> Interval | None:
    """The advice for a job of ``wall`` seconds whose ``saves`` saves took ``save_time`` seconds in all;
    ``save_starts``: each process's ``save_start`` events of the saves it finished, in order; ``step_seconds``: its
    steps' durations. None without a finished save."""
    if saves == 0 or save_time <= 0 or wall <= 0:
        return None
    save_cost = save_time / saves
    between = wall / faults_recomputing if faults_recomputing else wall
    optimum = math.sqrt(2.0 * save_cost * between)
    step = statistics.median(step_seconds) if step_seconds else None
    gaps = [(later["t"] - earlier["t"], later.get("step", 0) - earlier.get("step", 0))
            for starts in save_starts for earlier, later in zip(starts, starts[1:]) if later["t"] > earlier["t"]]
    current = statistics.median(seconds for seconds, _ in gaps) if gaps else None
    current_steps = round(statistics.median(steps for _, steps in gaps)) if gaps else None
    lost = None
    if current is not None and faults_recomputing:
        lost = max(0.0, wall * (_waste(current, save_cost, between) - _waste(optimum, save_cost, between)))
    return Interval(save_cost, saves, between, faults_recomputing, not faults_recomputing, optimum,
                    max(1, round(optimum / step)) if step else None, current, current_steps, lost)
