"""Where a job's time went, from its events: productive training, each cause of badput, and each fault's cost.

Every moment of the wall time gets one label, the first that holds of: a fault's detection, its dump, its restart
and reload or its in-place repair (from the fault to every rank training again); a checkpoint save; a step trained
again (a step this rank had completed before); a step (from the end of the rank's previous step, so the loop's own
work between steps counts); start-up (to the job's first step); else ``other`` (e.g. what follows the last step).

A fault is the cluster of what saw it: the fire drill's shot, the launcher's notice of a death, the watchdog's of a
hang, a survivor's of a peer's exit (MindSpore's built-in dump), a dying gasp (SIGTERM, an exception), a survivor
catching it. Its kind comes from the most direct witness in that order. Its rank is who failed, not who noticed first:
the rank the drill's shot or the watchdog names; else the worker torchrun's launcher found failed first (of several
found in one look, the one the workers' own record names, else the first); without the launcher's record (plain
torchrun), a peer's notice, else the first process to gasp (a SIGTERMed worker, before torchrun stops its peers) or
catch it. It ends when every rank trains again: each one repaired in place (one recovery generation), or
each process of the restarted job (torchrun's next attempt, or a launch by another launcher: msrun started again) at
its first step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ft_plugins.report.interval import Interval, advise
from ft_plugins.report.reading import Record
from ft_plugins.report.sizes import Size, sizes

DETECTION, DUMP, RESTART, IN_PLACE = "fault detection", "dump", "restart and reload", "in-place repair"
SAVES, RECOMPUTED, STARTUP, TRAINING, OTHER = "checkpoint saves", "steps recomputed", "start-up", "training", "other"
PRIORITY = (DETECTION, DUMP, RESTART, IN_PLACE, SAVES, RECOMPUTED, TRAINING, STARTUP)  # first wins
BADPUT = (STARTUP, SAVES, DETECTION, DUMP, RESTART, IN_PLACE, RECOMPUTED)
WITNESSES = ("injected", "watchdog", "launcher", "peer", "gasp", "caught")  # the most direct first
NAMING = ("injected", "watchdog", "peer")  # besides the launcher, those naming the rank at fault (others: their own)
SELF_NAMING = ("injected", "watchdog")  # they know the rank at fault better than any exit the launcher saw


@dataclass
class Fault:
    """One fault: when (seconds from the job's start), which rank, what kind, how it was met, what it cost."""

    at: float
    rank: int | None
    kind: str
    how: str
    section: str | None
    to_training: float | None  # seconds from the fault to every rank training again; None: never
    steps_lost: int
    steps_recomputed: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each part


@dataclass
class Report:
    job: str
    wall: float
    productive: float
    badput: dict[str, float]
    other: float
    faults: list[Fault]
    notes: list[str]
    interval: Interval | None = None  # the save interval the job should use (None: it finished no save)
    spans: list[tuple[float, float, str, Any]] = field(default_factory=list)  # (start, end, label, rank): the plot's
    sizes: list[Size] = field(default_factory=list)  # the data-parallel sizes after scale-ins (empty: never changed)

    @property
    def goodput(self) -> float:
        return 100.0 * self.productive / self.wall if self.wall > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {key: value for key, value in asdict(self).items() if key != "spans"}
        out["goodput_percent"] = round(self.goodput, 2)
        return out


def analyse(record: Record) -> Report:
    """The report of one job's events."""
    events = [(event, process) for process in record.processes for event in process.events]
    begin = min(event["t"] for event, _ in events)
    end = max(event.get("end", event["t"]) for event, _ in events)
    spans: list[tuple[float, float, str, Any]] = []
    steps = _steps(record, spans)
    starts = [start for start, _, label, _ in spans if label in (TRAINING, RECOMPUTED)]
    spans.append((begin, min(starts, default=end), STARTUP, None))
    faults = _faults(record, events, steps, spans, end)
    finished: list[list[dict[str, Any]]] = []  # each process's starts of the saves it finished
    saves_by_rank: dict[Any, int] = {}
    for process in record.processes:  # a save's end closes the newest start before it (a save cut short has none)
        opened = None
        finished.append([])
        for event in process.of("save_start", "save_end"):
            if event["ev"] == "save_end" and opened is not None:
                spans.append((opened["t"], event["t"], SAVES, process.rank))
                finished[-1].append(opened)
            opened = event if event["ev"] == "save_start" else None
        saves_by_rank[process.rank] = saves_by_rank.get(process.rank, 0) + len(finished[-1])
    totals = _sweep(spans)
    for fault in faults:
        fault.at -= begin
    badput = {label: totals.get(label, 0.0) for label in BADPUT}
    productive = totals.get(TRAINING, 0.0)
    other = max(0.0, end - begin - productive - sum(badput.values()))
    advice = advise(end - begin, badput[SAVES], max(saves_by_rank.values(), default=0), finished,
                    [stop - start for start, stop, _, _ in steps], sum(1 for fault in faults if fault.steps_recomputed))
    return Report(record.job, end - begin, productive, badput, other, faults, record.notes, advice,
                  [(start - begin, stop - begin, label, rank) for start, stop, label, rank in spans],
                  sizes(record, steps, begin))


def _steps(record: Record, spans: list) -> list[tuple[float, float, int, int | None]]:
    """Every step ended, as (start, end, step, rank); its span from the previous step's end in the same process
    when nothing else (a save, a fault) happened there in between."""
    done: dict[Any, set[int]] = {}
    found = []
    for process in sorted(record.processes, key=lambda process: process.start):
        previous: dict[str, Any] | None = None
        other = float("-inf")
        for event in process.events:
            if event["ev"] != "step":
                other = event["t"]
                continue
            start = event["t"]
            if previous is not None and previous["step"] == event["step"] - 1 and other < previous["end"]:
                start = previous["end"]
            seen = done.setdefault(process.rank, set())
            spans.append((start, event["end"], RECOMPUTED if event["step"] in seen else TRAINING, process.rank))
            seen.add(event["step"])
            found.append((event["t"], event["end"], event["step"], process.rank))
            previous = event
    return found


def _faults(record: Record, events: list, steps: list, spans: list, end: float) -> list[Fault]:
    witnessed = sorted(((event, process) for event, process in events if _witness(event) is not None),
                       key=lambda pair: pair[0]["t"])
    faults: list[Fault] = []
    closes = float("-inf")
    cluster: list = []
    for pair in witnessed + [None]:
        if pair is not None and pair[0]["t"] <= closes:
            cluster.append(pair)
            continue
        if cluster:
            faults.append(_fault(record, cluster, steps, spans, end))
        if pair is None:
            break
        cluster = [pair]
        again, _ = _again(record, _began(pair), end)
        closes = again if again is not None else end
    return faults


def _witness(event: dict[str, Any]) -> str | None:
    if event["ev"] == "fault" and event.get("kind"):
        return event.get("noticed", "launcher")
    return event["ev"] if event["ev"] in ("gasp", "caught") else None


def _began(pair: tuple) -> float:
    event = pair[0]
    return event["t"] - float(event.get("quiet") or 0.0)


def _again(record: Record, began: float, end: float) -> tuple[float | None, Any]:
    """When every rank trains again after a fault that began at ``began``, and how: ``("in place", K)`` or
    ``("restart", first step)``; (None, None) when the job never did."""
    repaired = sorted(((event, process) for process in record.processes for event in process.of("recovered")
                       if event["t"] > began), key=lambda pair: pair[0]["t"])
    before = {process.run for process in record.processes if process.start <= began}
    restarted = [process for process in record.processes if process.start > began and process.of("step")
                 and process.role == "worker" and process.generation == 0 and process.run not in before]
    first_restart = min((process.start for process in restarted), default=None)
    if repaired and (first_restart is None or repaired[0][0]["t"] < first_restart):
        which = (repaired[0][1].attempt, repaired[0][0].get("generation"))
        same = [event for event, process in repaired if (process.attempt, event.get("generation")) == which]
        return max(event["t"] for event in same), ("in place", max(event.get("step", 0) for event in same))
    if restarted:
        run = min(restarted, key=lambda process: process.start).run
        firsts = [process.of("step")[0] for process in restarted if process.run == run]
        return max(event["t"] for event in firsts), ("restart", min(event["step"] for event in firsts) - 1)
    return None, None


def _fault(record: Record, cluster: list, steps: list, spans: list, end: float) -> Fault:
    event, _ = _most_direct(cluster)
    began = min(_began(pair) for pair in cluster)
    rank = _failed_rank(cluster)
    kind = event.get("kind") or "death"
    noticed = min((pair[0]["t"] for pair in cluster if _witness(pair[0]) != "injected"), default=began)
    again, met = _again(record, began, end)
    how, resumed = met if met is not None else ("not met: the job ended", None)
    dumps = [pair[0]["t"] for pair in cluster if pair[0]["ev"] == "gasp"]
    dumped = [event["t"] for process in record.processes for event in process.of("dump")
              if began <= event["t"] <= (again or end)]
    phases = {DETECTION: (began, noticed)}
    if dumped:
        phases[DUMP] = (min(dumps, default=noticed), max(dumped))
    stop = again if again is not None else end
    phases[IN_PLACE if how == "in place" else RESTART] = (max(noticed, max(dumped, default=noticed)), stop)
    for label, (start, stop_at) in phases.items():
        spans.append((start, max(start, stop_at), label, rank))
    if how == "restart":
        how = "dump + restart" if dumped else "restart"
    scaled = [event for process in record.processes for event in process.of("scale_in")
              if began <= event["t"] <= (again or end)]
    if how == "in place" and scaled:
        how = f"scale-in {scaled[0]['before']} -> {scaled[0]['data_parallel']}"
    if kind == "hang":
        how = f"hang kill, {how}"
    completed = max((step for _, finished, step, _ in steps if finished <= began), default=0)
    lost = max(0, completed - resumed) if resumed is not None else completed
    again_at = again if again is not None else end
    redone = {step for start, _, step, _ in steps if start >= again_at and step <= completed} if again else set()
    return Fault(began, rank, kind, how, event.get("section"), None if again is None else again - began, lost,
                 len(redone), {label: max(0.0, stop_at - start) for label, (start, stop_at) in phases.items()})


def _most_direct(pairs: list) -> tuple:
    """The (event, process) of the most direct witness among ``pairs`` (the earliest of them, of one kind)."""
    return min(pairs, key=lambda pair: WITNESSES.index(_witness(pair[0])))


def _failed_rank(cluster: list) -> int | None:
    """Who failed (see the module's docstring): the drill's shot or the watchdog, which name the rank at fault, else
    the launcher's first look (the workers' own record between the ranks that look found), else the workers' own
    record. The launcher sees who exited first, which is not who failed where the fault is a rank's own (a raise, a
    hang): its peers fall back and may exit before it."""
    own = [pair for pair in cluster if _witness(pair[0]) != "launcher"]
    named = None
    if own:
        event, process = _most_direct(own)
        named = event.get("rank") if _witness(event) in NAMING else process.rank
        if _witness(event) in SELF_NAMING:
            return named
    seen = [event for event, _ in cluster if _witness(event) == "launcher"]  # in time order: the cluster's
    first_look = [event.get("rank") for event in seen if event["t"] == seen[0]["t"]]
    return named if not first_look or named in first_look else first_look[0]


def _sweep(spans: list[tuple[float, float, str, Any]]) -> dict[str, float]:
    """Seconds of each label, each moment counted once under the first label of :data:`PRIORITY` that holds."""
    marks = []
    for start, stop, label, _ in spans:
        if stop > start:
            marks += [(start, 1, label), (stop, -1, label)]
    marks.sort(key=lambda mark: mark[0])
    active = dict.fromkeys(PRIORITY, 0)
    totals: dict[str, float] = {}
    last = marks[0][0] if marks else 0.0
    for when, change, label in marks:
        if when > last:
            held = next((name for name in PRIORITY if active[name] > 0), OTHER)
            totals[held] = totals.get(held, 0.0) + when - last
            last = when
        active[label] += change
    return totals
