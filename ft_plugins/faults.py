"""Fault injection for fire drills: ``FT_PLUGINS_INJECT_FAULT`` makes a worker fail on purpose.

``rank=R,step=N,kind=kill|term|exception|exit|hang|stuck|slow``
``[,at=forward|update|save|join|regroup|data|collective|device|gc]``
``[,attempt=A][,life=L][,seconds=S]``; ``hang`` blocks for good, ``stuck`` too and ignores SIGTERM besides (a
process in a driver call: only SIGKILL ends it), ``slow`` pauses ``S`` seconds (default 10) and goes on.
``at=data`` fires as the step asks for its first batch, ``at=collective`` blocks in a collective no peer
enters (with ``hang`` or ``stuck``), ``at=device`` as the step starts, after a kernel that runs ``S`` seconds
is queued on the device's current stream (CUDA: what a collective blocked on a lost peer is to the device;
``term`` then shows what a dump does behind it), ``at=gc`` as the step starts, a ``slow`` fault then spent inside a
collection of the oldest generation (a long garbage-collection pause);
several faults are separated by ``;``. ``step=N`` is the step that starts after N completed steps (the one whose
profiler range is ``step N``), so a dump that loses nothing holds iteration N. A fault fires once
per job: on launcher attempt ``A`` only (default 0; torchrun's ``TORCHELASTIC_RESTART_COUNT``),
so the restarted job trains on; and in life ``L`` of the rank only (default 0: the process first
started; 1: its first in-place replacement, ``recover``), so a replacement does not fire its
predecessor's fault again. ``at=join`` fires in a replacement as it joins the survivors, ``at=regroup`` in every
rank of a repair (or a scale-in) as it is about to build the groups again. Parsing is framework-neutral; where each ``at`` point lies is the
framework glue's business.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ft_plugins import events
from ft_plugins.config import INJECT_VAR, RESTART_VAR, ConfigError
from ft_plugins.rank import global_rank
from ft_plugins.recovery import replacement

log = logging.getLogger("ft_plugins.faults")

KINDS = ("kill", "term", "exception", "exit", "hang", "stuck", "slow")
KEYS = ("rank", "step", "kind", "at", "attempt", "life", "seconds")
SLOW = 10  # seconds a ``slow`` fault lasts unless ``seconds=`` says
POINTS = ("forward", "update", "save", "join", "regroup", "data", "collective", "device", "gc")
EXAMPLE = "rank=1,step=3,kind=kill,at=forward"
# what each kind is in the job's events (``slow`` is no fault)
FAULT_KINDS = {"kill": "death", "term": "signal", "exception": "exception", "exit": "exception", "hang": "hang",
               "stuck": "hang"}


class InjectedFault(RuntimeError):
    """The exception a ``kind=exception`` fault raises inside the training step."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str
    at: str = "forward"
    attempt: int = 0
    life: int = 0
    seconds: int = SLOW

    def __str__(self) -> str:
        life = f",life={self.life}" if self.life else ""
        seconds = f",seconds={self.seconds}" if self.kind == "slow" else ""
        return f"rank={self.rank},step={self.step},kind={self.kind},at={self.at},attempt={self.attempt}{life}{seconds}"


def _number(key: str, raw: str, item: str, source: str) -> int:
    if not raw.isdigit():
        raise ConfigError(f"{source}: {key}={raw!r} in {item!r} is not a whole number >= 0; e.g. {source}={EXAMPLE!r}")
    return int(raw)


def parse_faults(raw: str, source: str = INJECT_VAR) -> tuple[Fault, ...]:
    """Every fault in ``raw`` (empty: none); ConfigError naming the variable, the item and the fix."""
    faults = []
    for item in (part.strip() for part in raw.split(";")):
        if not item:
            continue
        fields: dict[str, str] = {}
        for pair in (part.strip() for part in item.split(",")):
            key, sep, value = pair.partition("=")
            key, value = key.strip().lower(), value.strip().lower()
            if not sep or key not in KEYS or key in fields:
                raise ConfigError(f"{source}: {pair!r} in {item!r} is not one of {'=, '.join(KEYS)}= (each once); "
                                  f"e.g. {source}={EXAMPLE!r}")
            fields[key] = value
        missing = [key for key in ("rank", "step", "kind") if key not in fields]
        if missing:
            raise ConfigError(f"{source}: {item!r} lacks {', '.join(missing)}; e.g. {source}={EXAMPLE!r}")
        if fields["kind"] not in KINDS:
            raise ConfigError(f"{source}: kind={fields['kind']!r} is not one of {', '.join(KINDS)}")
        at = fields.get("at", "forward")
        if at not in POINTS:
            raise ConfigError(f"{source}: at={at!r} is not one of {', '.join(POINTS)}")
        faults.append(Fault(_number("rank", fields["rank"], item, source), _number("step", fields["step"], item, source),
                            fields["kind"], at, _number("attempt", fields.get("attempt", "0"), item, source),
                            _number("life", fields.get("life", "0"), item, source),
                            _number("seconds", fields.get("seconds", str(SLOW)), item, source)))
    return tuple(faults)


def planned(rank: int, env: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    """The faults this rank fires on this launcher attempt, in this life; ConfigError for a malformed variable."""
    env = os.environ if env is None else env
    attempt = env.get(RESTART_VAR, "0")
    attempt_number = int(attempt) if attempt.isdigit() else 0
    place = replacement(env)
    life = place.life if place is not None else 0
    return tuple(fault for fault in parse_faults(env.get(INJECT_VAR, ""))
                 if fault.rank == rank and fault.attempt == attempt_number and fault.life == life)


def fire(fault: Fault, block: Callable[[], object] | None = None) -> None:
    """Make the fault happen in this process, now: SIGKILL, SIGTERM, an exception, ``sys.exit(3)`` (a script's
    own error path: no traceback), a pause of ``seconds`` (``slow``: long, but not a hang), or a hang: ``block``
    (the framework's wait that never ends, e.g. a collective no peer enters), else a sleep for good; ``stuck``
    ignores SIGTERM first (from the main thread)."""
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault.kind == "exception":
        raise InjectedFault(f"fault injected by {INJECT_VAR}: {fault}")
    elif fault.kind == "exit":
        sys.exit(3)
    elif fault.kind == "slow" and fault.at == "gc":
        _collect_slowly(fault.seconds)
    elif fault.kind == "slow":
        time.sleep(fault.seconds)
    else:
        if fault.kind == "stuck":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if block is not None:
            block()
        while True:  # a hung rank: only a signal ends it
            time.sleep(3600)


def _collect_slowly(seconds: float) -> None:
    """A collection of the oldest generation that lasts ``seconds``: the pause a large heap's collection makes."""
    def pause(phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            time.sleep(seconds)

    gc.callbacks.append(pause)  # after any callback already there: they see the collection begin first
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(pause)


class Drill:
    """This process's planned faults, each fired once where the framework glue says its point is reached."""

    def __init__(self) -> None:
        self._planned: list[Fault] | None = None

    def plans(self, point: str, step: int) -> bool:
        """Whether a fault is planned at ``point`` in ``step``."""
        return any(fault.at == point and fault.step == step for fault in self._faults())

    def reached(self, point: str, step: int | None = None, block: Callable[[], object] | None = None,
                before: Callable[[Fault], object] | None = None) -> None:
        """Fire every planned fault at ``point`` (and ``step``, unless None: ``join`` has no step); a hang
        blocks in ``block`` when given; ``before(fault)`` runs first (what the point sets up)."""
        for fault in list(self._faults()):
            if fault.at == point and (step is None or fault.step == step):
                self._faults().remove(fault)
                if before is not None:
                    before(fault)
                log.warning("firing injected fault %s", fault)
                events.emit("fault", rank=fault.rank, kind=FAULT_KINDS.get(fault.kind), completed=fault.step,
                            section=point, noticed="injected")
                fire(fault, block)

    def _faults(self) -> list[Fault]:
        if self._planned is None:
            self._planned = list(planned(global_rank() or 0))
        return self._planned
