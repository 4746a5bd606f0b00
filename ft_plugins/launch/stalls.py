"""The launcher's judgement of its workers' progress reports, free of processes and signals (the watchdog acts).

When one rank hangs, its peers soon stop too: they wait for it inside a collective. So "who stopped" is not
"who hung". Once a rank is past its bound, every rank quiet for half its own bound is asked for its stacks;
a rank whose main thread waits in a collective, or that entered more collectives on a group than a peer in it
(:func:`ahead`), is a victim; one that does neither is a culprit. One culprit among
victims (or among ranks still moving) is a hang: end the culprit, the job goes on as after a death. Victims of a
rank still within its own bound (a long save) wait with it. Every rank stalled alike (all waiting in collectives,
or none waiting: a file system or a store that stopped answering, a machine slowed for all, which is waited on for
the ``stall`` bound first), or a second hang before any step moved on, is told apart: the whole job dumps and
restarts, never a replacement loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from ft_plugins.features.hangs import Bounds
from ft_plugins.progress import BETWEEN, Record

# where a main thread waits for its peers, its innermost frame: torch's collectives, the waits on Megatron's
# gradient reductions and pipeline communication
WAIT_SITES = ("/torch/distributed/", "/megatron/core/distributed/param_and_grad_buffer.py",
              "/megatron/core/pipeline_parallel/p2p_communication.py")
# MindSpore runs a step's collectives asynchronously inside the train network's step cell: a main thread waits
# for its peers wherever that step synchronises, so any frame of these counts
MINDSPORE_STEP_SITES = ("/mindspore/nn/wrap/cell_wrapper.py", "/mindspore/nn/wrap/grad_reducer.py",
                        "/mindformers/wrapper/")
HANG, ALL, WAIT = "hang", "all", "wait"
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")


@dataclass
class Watch:
    """One worker process as its launcher sees it: its last report and when anything last moved."""

    pid: int
    moved: float  # when its report last changed (or when the launcher first saw the process)
    record: Record | None = None

    def observe(self, record: Record | None, now: float, bounds: Bounds) -> None:
        """Take a report read at ``now``; a step that ended since the last one teaches ``bounds`` its duration."""
        if record is None or record.pid != self.pid or record == self.record:
            return  # not reporting yet (the file is a previous process's), or nothing moved
        if record.lasted_begun and (self.record is None or record.lasted_begun != self.record.lasted_begun):
            bounds.learn(record.lasted, record.lasted_begun)
        self.record, self.moved = record, now

    @property
    def reporting(self) -> bool:
        return self.record is not None

    def bound(self, bounds: Bounds) -> float:
        record = self.record
        return bounds.bound(record.section, record.begun) if record is not None else float("inf")

    def quiet(self, now: float) -> float:
        return now - self.moved

    def where(self) -> str:
        record = self.record
        if record is None:
            return "set-up, not reporting"
        section = "between steps" if record.section == BETWEEN else record.section_name
        return f"{section} of step {record.step}" if record.step else section


@dataclass
class Verdict:
    kind: str  # HANG, ALL or WAIT
    culprits: list[int] = field(default_factory=list)  # ranks to end (HANG)
    victims: list[int] = field(default_factory=list)  # ranks waiting in a collective
    freed: list[int] = field(default_factory=list)  # ranks whose wait for a peer just ended: a full bound again
    why: str = ""


def overdue(watches: Mapping[int, Watch], now: float, bounds: Bounds) -> list[int]:
    """Ranks past their section's bound."""
    return [rank for rank, watch in watches.items() if watch.reporting and watch.quiet(now) > watch.bound(bounds)]


def stuck(watches: Mapping[int, Watch], now: float, bounds: Bounds) -> list[int]:
    """Ranks quiet for at least half their bound: those a hang may have stopped too."""
    return [rank for rank, watch in watches.items()
            if watch.reporting and watch.quiet(now) >= watch.bound(bounds) / 2]


def main_frames(stacks: str, thread: int) -> list[str]:
    """The ``File ...`` lines of thread ``thread`` in a faulthandler dump (empty when it is not there)."""
    frames: list[str] = []
    inside = False
    for line in stacks.splitlines():
        found = _THREAD.match(line.strip())
        if found:
            inside = int(found.group(1), 16) == thread
        elif inside and line.strip().startswith("File "):
            frames.append(line.strip())
    return frames


def waits_on_peers(frames: Sequence[str]) -> bool:
    """Whether a main thread stands inside a collective (it waits for a peer): its innermost frame is one
    (a model's forward runs inside Megatron's DDP wrapper: an outer frame says nothing); on MindSpore, any
    frame in the train network's step (a rank hung there in a driver call is then taken for a victim: with
    no culprit left, the job dumps and restarts as a whole)."""
    return bool(frames) and (any(site in frames[0] for site in WAIT_SITES)
                             or any(site in frame for frame in frames for site in MINDSPORE_STEP_SITES))


def ahead(entered: Mapping[int, Mapping[int, int]], elsewhere: Mapping[int, int] | None = None) -> set[int]:
    """The ranks that entered more collectives on a process group than a peer in it (``entered``: rank -> group key
    -> collectives; :func:`ft_plugins.progress.collectives`; ``elsewhere``: group key -> the fewest a rank of
    another node entered, :mod:`.node_counts`): each waits for that peer, wherever its main thread stands (on NCCL
    or HCCL a collective returns at once and its rank blocks later, outside any collective's frame). A group
    counted by one rank alone, and by no rank elsewhere, tells nothing."""
    least = fewest(entered, elsewhere)
    return {rank for rank, groups in entered.items() if any(count > least[key] for key, count in groups.items())}


def behind(entered: Mapping[int, Mapping[int, int]]) -> set[int]:
    """The ranks that entered fewer collectives on a process group than a peer in it: where every rank waits, one
    of them is missing from the collective its peers wait in (it waits for something that never comes)."""
    most: dict[int, int] = {}
    for groups in entered.values():
        for key, count in groups.items():
            most[key] = max(count, most.get(key, count))
    return {rank for rank, groups in entered.items() if any(count < most[key] for key, count in groups.items())}


def fewest(entered: Mapping[int, Mapping[int, int]], elsewhere: Mapping[int, int] | None = None) -> dict[int, int]:
    """Per group key, the fewest collectives one of these ranks (or one elsewhere) entered."""
    least = dict(elsewhere or {})
    for groups in entered.values():
        for key, count in groups.items():
            least[key] = min(count, least.get(key, count))
    return least


def judge(stopped: Sequence[int], moving: Sequence[int], waiting: Mapping[int, bool], repeated: bool,
          remote: bool = False, patient: bool = False, stalled: bool = True, waited: Collection[int] = (),
          missing: Collection[int] = ()) -> Verdict:
    """What the stop of ``stopped`` ranks is (``waiting``: which of them wait in a collective), with ``moving``
    ranks still reporting. ``repeated``: a hang was already answered and no step moved since. ``remote``: ranks
    on other nodes, whose launchers may find the culprit; ``patient``: within twice the bound, so they may.
    ``stalled``: past the bound of every rank stopped outside collectives alike (False: they are waited on).
    ``waited``: the ranks the last look found waiting for a peer within its bound; one of them out of its collective
    now was freed by that peer a moment ago (it still finishes its step), not hung. ``missing``: ranks behind a peer
    in a group's collectives and ahead in none: where every rank waits, they are the culprits (missing from their
    peers' one)."""
    victims = [rank for rank in stopped if waiting.get(rank)]
    culprits = [rank for rank in stopped if not waiting.get(rank)]
    if not culprits and any(rank not in missing for rank in victims):
        culprits = [rank for rank in victims if rank in missing]
        victims = [rank for rank in victims if rank not in missing]
    if repeated:
        return Verdict(ALL, victims=victims, why="stopped again at the step of the hang just answered")
    freed = [rank for rank in culprits if rank in waited]
    if freed:
        return Verdict(WAIT, victims=victims, freed=freed, why="their wait for a peer just ended")
    if culprits and (victims or moving):
        return Verdict(HANG, culprits, victims)
    if not culprits and moving:
        return Verdict(WAIT, victims=victims, why="they wait for a rank still within its bound (a long save?)")
    if not culprits and remote and patient:
        return Verdict(WAIT, victims=victims, why="every local rank waits in a collective: for a rank elsewhere")
    if culprits and not stalled:  # none waits for another: a file system, a store, a machine slowed for all?
        return Verdict(WAIT, why="every rank stopped outside collectives alike, within the bound for that")
    if remote:  # the ranks of other nodes are not seen from here: say only what is
        why = ("every rank of this node waits in a collective, past twice its bound" if not culprits else
               "every rank of this node stopped outside collectives (ranks on other nodes are not seen from here: "
               "this node's hang, or a file system or store not answering?)")
    else:
        why = ("every rank waits in a collective and none is missing from it here" if not culprits else
               "no rank waits for another: they all stopped outside collectives (a file system or store not "
               "answering?)")
    return Verdict(ALL, victims=victims, why=why)

