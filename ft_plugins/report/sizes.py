"""The job's data-parallel sizes after scale-ins (``elastic``), and the throughput at each: each change is a
``scale_in`` event (every rank that goes on records it; one change per recovery generation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ft_plugins.report.reading import Record


@dataclass
class Size:
    """A stretch of the job at one data-parallel size: from ``since`` (seconds from the job's start) on."""

    data_parallel: int
    since: float
    steps: int  # steps run whole at this size, each counted once (not the one a scale-in interrupted)
    seconds: float  # from the first of those steps' start to the last one's end

    @property
    def per_second(self) -> float | None:
        return self.steps / self.seconds if self.seconds > 0 else None


def sizes(record: Record, steps: list[tuple[float, float, int, Any]], begin: float) -> list[Size]:
    """Each data-parallel size the job trained at, in order; empty when it never changed. ``steps``: every step
    ended, as (start, end, step, rank)."""
    changes: dict[Any, dict[str, Any]] = {}
    for process in record.processes:
        for event in process.of("scale_in"):
            place = (process.attempt, event.get("generation"))
            if place not in changes or event["t"] < changes[place]["t"]:
                changes[place] = event
    if not changes:
        return []
    ordered = sorted(changes.values(), key=lambda event: event["t"])
    bounds = [begin, *(event["t"] for event in ordered), float("inf")]
    found = []
    for index, size in enumerate([ordered[0]["before"], *(event["data_parallel"] for event in ordered)]):
        inside = [(start, end, step) for start, end, step, _ in steps if bounds[index] <= start and end < bounds[index + 1]]
        seconds = max((end for _, end, _ in inside), default=0.0) - min((start for start, _, _ in inside), default=0.0)
        found.append(Size(size, bounds[index] - begin, len({step for _, _, step in inside}), seconds))
    return found
