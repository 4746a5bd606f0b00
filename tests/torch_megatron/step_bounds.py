"""The step bound ``hangs`` names a Megatron hang with, checked against what its rule gives for the steps the job's
log shows: a loaded machine makes every step slower and the launcher's bound follows them (5 x a 0.72 s step is
3.6 s, not the floor of 3 s), so no fixed number holds."""

from __future__ import annotations

import re

from ttp_runs import Job

RULE = re.compile(r"bounds: a step max\(([0-9.]+) s, ([0-9.]+) x the slowest step\)")
ITERATION = re.compile(r"iteration +\d+/ +\d+ \| consumed samples: +\d+ \| "
                       r"elapsed time per iteration \(ms\): ([0-9.]+)")
MONITOR_INTERVAL = 0.1  # torchrun's default round, on which the launcher reads each rank's progress


def step_bound(job: Job, line: str) -> tuple[float, float]:
    """(bound, factor) of ``line``, the launcher's line naming a hang, once the bound is asserted to follow the job's
    rule, ``max(floor, factor x the slowest step)``: at least the floor, and at most what the steps Megatron logs
    (its last rank, one line an iteration, the first a warm-up one that teaches nothing) may have taught. A rank that
    does not log starts its step while the last rank still ends its previous one, so one rank's step lasts at most
    two logged iterations; the launcher reads it a round late at either end."""
    rule = RULE.search(job.output)
    bound = re.search(r"\(bound ([0-9.]+) s\)", line)
    assert rule and bound, line
    floor, factor, said = float(rule.group(1)), float(rule.group(2)), float(bound.group(1))
    iterations = [float(ms) / 1000 for ms in ITERATION.findall(job.output)][1:]
    assert iterations, job.output[-4000:]
    longest = max((first + second for first, second in zip(iterations, iterations[1:])), default=iterations[0])
    high = max(floor, factor * (longest + 2 * MONITOR_INTERVAL))
    assert floor - 0.05 <= said <= high + 0.05, (said, floor, high, iterations)
    return said, factor
