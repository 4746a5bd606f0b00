"""``hangs``: a rank that stops making progress is found within a bound learned from the job's own steps.

Every worker reports where it stands (:mod:`ft_plugins.progress`); ``ft-plugins run``'s torchrun or msrun watches
the reports (:mod:`ft_plugins.launch.watchdog`). A rank is hung when it has not moved within its section's bound:
``max(floor, factor x the slowest step seen)`` for a step (the slowest warm-up step until a later one was seen),
the ``warmup`` bound for set-up, the first ``warmup_steps`` steps of a process and what follows the training loop,
and ``data`` (the wait for a batch), ``gc`` (a collection of the oldest generation), ``save``, ``eval`` and
``recovery`` (dump, in-place repair) bounds of their own: what pauses a healthy rank is named, so the step's own
bound can be tight. The hung rank's stacks go to the log, then it is ended (SIGTERM, SIGKILL after ``grace``) and
the job goes the way a death goes: ``recover`` in place, else ``ttp``'s dump and torchrun's restart (msrun stops
the job; its relaunch resumes). Every rank stopped outside collectives alike is no one rank's hang: that waits
``stall`` before the whole job dumps and restarts. It ends processes, so ``FT_PLUGINS=auto`` never turns it on:
only its name or ``all`` does.
"""

from __future__ import annotations

from typing import Any, Mapping

from ft_plugins.config import Option, parse_count, parse_seconds
from ft_plugins.features.base import Feature
from ft_plugins.vendors import VendorUnavailable

# sections, by code: what a rank is doing (reported through :mod:`ft_plugins.progress`); each has its own bound.
# Named here, where the bounds are, so that every process can weigh them without loading the reporting itself.
SECTIONS = ("setup", "step", "data", "save", "eval", "dump", "recovery", "between", "end", "gc")
SETUP, STEP, DATA, SAVE, EVAL, DUMP, RECOVERY, BETWEEN, END, GC = range(len(SECTIONS))
PAUSES = {DATA: "data", GC: "gc", SAVE: "save", EVAL: "eval", DUMP: "recovery", RECOVERY: "recovery"}


class Bounds:
    """How long each section may go without a report, learned from the steps this job has run."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = dict(settings)
        self.slowest = 0.0  # the slowest step seen after warm-up, in seconds
        self.warm = 0.0  # the slowest warm-up step seen (compilation, first batches)

    def learn(self, seconds: float, begun: int) -> None:
        """A step took ``seconds``; the ``begun``-th of its process (warm-up steps only stand in until a step
        after them was seen: compilation)."""
        if begun > self.settings["warmup_steps"]:
            self.slowest = max(self.slowest, seconds)
        else:
            self.warm = max(self.warm, seconds)

    def step(self) -> float:
        """A step's bound: scaled from the slowest step after warm-up; until one was seen, from the slowest warm-up
        step (never above the warm-up bound), else the warm-up bound itself."""
        s = self.settings
        if self.slowest:
            return max(s["floor"], s["factor"] * self.slowest)
        if self.warm:
            return max(s["floor"], min(s["warmup"], s["factor"] * self.warm))
        return max(s["warmup"], s["floor"])

    def bound(self, section: int, begun: int) -> float:
        """Seconds a rank in ``section`` (its ``begun``-th step of this process) may stay without a report."""
        if section in (SETUP, END) or begun <= self.settings["warmup_steps"]:
            return max(self.settings["warmup"], self.step())
        pause = PAUSES.get(section)
        return max(self.settings[pause], self.step()) if pause else self.step()

    def describe(self) -> str:
        s = self.settings
        return (f"a step max({s['floor']:g} s, {s['factor']:g} x the slowest step), set-up, the first "
                f"{s['warmup_steps']} steps and the end {s['warmup']:g} s, a batch {s['data']:g} s, "
                f"garbage collection {s['gc']:g} s, save {s['save']:g} s, eval {s['eval']:g} s, dump or recovery "
                f"{s['recovery']:g} s, every rank still outside collectives {s['stall']:g} s; then stacks, SIGTERM, "
                f"SIGKILL after {s['grace']:g} s")


class Hangs(Feature):
    name = "hangs"
    summary = "a rank that stops making progress is found, its stacks logged, and it is ended like a death"
    options = (
        Option("floor", 1.0, "least seconds a step may go without progress", parse_seconds),
        Option("factor", 5.0, "a step's bound is this many times the slowest step seen (never below floor)",
               parse_seconds),
        Option("warmup", 900.0, "seconds for set-up, each of the first warmup_steps steps of a process, and what "
               "follows the training loop (final evaluation and save, exit)",
               parse_seconds),
        Option("warmup_steps", 2, "steps of each process under the warmup bound (compilation, first batches)",
               parse_count),
        Option("data", 60.0, "seconds a rank may wait for its next batch (a data loader that stalls)",
               parse_seconds),
        Option("gc", 60.0, "seconds a garbage collection of the oldest generation may take", parse_seconds),
        Option("save", 900.0, "seconds a checkpoint save may take", parse_seconds),
        Option("eval", 900.0, "seconds an evaluation may take", parse_seconds),
        Option("recovery", 900.0, "seconds a dump or an in-place recovery may take", parse_seconds),
        Option("stall", 60.0, "seconds every rank may stand still outside collectives alike (a file system, a store "
               "or a machine slowed for all) before the whole job dumps and restarts", parse_seconds),
        Option("grace", 5.0, "seconds between SIGTERM and SIGKILL for a hung rank", parse_seconds),
    )

    def start(self) -> str:
        if not self.requested:
            raise VendorUnavailable("hangs ends processes that stop making progress: it runs only when asked for "
                                    "(FT_PLUGINS=hangs,... or all)")
        launcher = "msrun" if self.framework == "ms" else "torchrun"
        return f"watched by ft-plugins run's {launcher}; bounds: {Bounds(self.settings).describe()}"
