"""Reading a job's events (:mod:`ft_plugins.events`) back: every process's file, one job, one clock.

What cannot be read into one job is refused with one line (:class:`Refused`): no events where it looked, events
of several jobs in one folder (unless one is chosen). What can be read with a caveat is read, and the caveat kept
as a note: a last line cut short (a process killed as it wrote), a line that is not an event, a node whose clock
disagrees with the others' (the same step ends at the same moment on every rank: a collective ends it; the
other nodes' times are shifted onto the first node's clock, and the note says by how much).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from ft_plugins.events import FOLDER

CLOCK_TOLERANCE = 0.25  # seconds two nodes' clocks may differ before their times are shifted


class Refused(Exception):
    """Events that cannot be made into one job's report; the message is one line saying why and what to do."""


@dataclass
class Process:
    """One process's events: its file's first line (who it is), then what it recorded, in time order."""

    path: str
    job: str
    role: str
    rank: int | None
    host: str
    attempt: int
    start: float
    events: list[dict[str, Any]] = field(default_factory=list)
    launch: str = ""  # the launcher that started it (host and parent pid): msrun relaunched is another one
    generation: int = 0  # > 0: a lost rank's replacement, started by the recovery of that generation

    @property
    def run(self) -> tuple[int, str]:
        """Which start of the job it belongs to: a restart attempt of one launcher, or another launch."""
        return self.attempt, self.launch

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["ev"] in kinds]


@dataclass
class Record:
    """One job's processes, on one clock, and what the reader had to assume."""

    folder: str
    job: str
    processes: list[Process]
    notes: list[str] = field(default_factory=list)


def events_folder(path: str) -> str:
    """``path`` itself when it holds events files, else its ``ft_events`` folder (a job's save directory)."""
    inner = os.path.join(path, FOLDER)
    if not glob.glob(os.path.join(path, "*.jsonl")) and os.path.isdir(inner):
        return inner
    return path


def read(path: str, job: str | None = None) -> Record:
    """The events of one job under ``path``; ``job`` picks one when the folder holds several."""
    folder = events_folder(path)
    files = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
    if not files:
        raise Refused(f"no events found: looked for *.jsonl in {path}" + (
            "" if folder != path else f" and {os.path.join(path, FOLDER)}") +
            " (written by jobs under ft_plugins with --save or FT_PLUGINS_EVENTS_DIR)")
    notes: list[str] = []
    processes = [process for process in (_read_file(name, notes) for name in files) if process is not None]
    jobs = sorted({process.job for process in processes})
    if job is not None:
        if job not in jobs:
            raise Refused(f"no events of job {job} in {folder}; it holds {', '.join(jobs) or 'none'}")
        processes = [process for process in processes if process.job == job]
    elif len(jobs) > 1:
        raise Refused(f"events of {len(jobs)} jobs in {folder} ({', '.join(jobs)}): choose one with --job ID")
    if not processes:
        raise Refused(f"no readable events in {folder}: {'; '.join(notes)}")
    record = Record(folder, processes[0].job, processes, notes)
    one_clock(record)
    return record


def _read_file(path: str, notes: list[str]) -> Process | None:
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except OSError as exc:
        notes.append(f"{name}: unreadable ({exc.strerror}); left out")
        return None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:  # no newline after the last line: the process was killed as it wrote it
        lines.pop()
        notes.append(f"{name}: its last line was cut short (the process ended as it wrote); read up to it")
    events, bad = [], 0
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("t"), (int, float)) and isinstance(event.get("ev"), str):
            events.append(event)
        else:
            bad += 1
    if bad:
        notes.append(f"{name}: {bad} line{'s' if bad > 1 else ''} not an event; skipped")
    if not events or events[0]["ev"] != "start":
        notes.append(f"{name}: does not begin with a process's start; left out")
        return None
    head = events[0]
    events.sort(key=lambda event: event["t"])
    return Process(path, str(head.get("job")), str(head.get("role", "worker")), head.get("rank"),
                   str(head.get("host", "")), int(head.get("attempt", 0) or 0), head["t"], events,
                   f"{head.get('host', '')}/{head['parent']}" if "parent" in head else "",
                   int(head.get("generation", 0) or 0))


def one_clock(record: Record) -> None:
    """Shift every node's times onto the first node's clock when they disagree (see the module's docstring)."""
    hosts = sorted({process.host for process in record.processes})
    if len(hosts) < 2:
        return
    ends = {host: _step_ends(record, host) for host in hosts}
    reference = max(hosts, key=lambda host: len(ends[host]))
    for host in hosts:
        if host == reference:
            continue
        common = ends[host].keys() & ends[reference].keys()
        if not common:
            record.notes.append(f"clocks: {host} shares no step with {reference}; its clock is taken as it is")
            continue
        offset = statistics.median(ends[reference][key] - ends[host][key] for key in common)
        if abs(offset) <= CLOCK_TOLERANCE:
            continue
        for process in record.processes:
            if process.host == host:
                process.start += offset
                for event in process.events:
                    event["t"] += offset
                    if "end" in event:
                        event["end"] += offset
        record.notes.append(f"clocks: {host} runs {abs(offset):.2f} s {'behind' if offset > 0 else 'ahead of'} "
                            f"{reference} (from {len(common)} step ends, which a collective makes simultaneous); "
                            f"{reference}'s clock assumed, {host}'s times shifted")


def _step_ends(record: Record, host: str) -> dict[tuple[int, int], float]:
    """(attempt, step) -> when it ended last on ``host``."""
    found: dict[tuple[int, int], float] = {}
    for process in record.processes:
        if process.host == host:
            for event in process.of("step"):
                key = (process.attempt, event.get("step"))
                found[key] = max(found.get(key, 0.0), event["end"])
    return found
