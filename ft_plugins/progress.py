"""Where a worker stands, told to its launcher cheaply, so the launcher can find a rank that stopped moving.

Each worker owns one small file, ``<dir>/<rank>``, in a directory its launcher names in ``FT_PLUGINS_PROGRESS``
(set by ``ft-plugins run``'s torchrun, which watches: :mod:`ft_plugins.launch.watchdog`). The file is mapped
into memory: a report is one ``struct.pack_into`` (about a microsecond), never a system call. The launcher
reads the files on its own monitoring round and times the silences itself; the worker times only its steps (the
clock read as a step begins and ends), which the launcher's rounds would miss when they are shorter than a round.

At :func:`start` the worker also registers ``faulthandler`` on ``SIGUSR2`` to write the Python stacks of all
its threads to ``<dir>/<rank>.stacks``: the C handler runs even while the main thread is blocked in a driver
call or a collective, so a launcher can ask a hung rank where it stands.

A collection of the oldest generation on the main thread is reported as a section of its own (``gc``) and the
section it interrupted again after it: a long collection is a pause with its own bound, not a hang.

The file also counts, per process group, the collectives the rank entered (:func:`entered`). Every member of a
group enters the same collectives on it in the same order, so a rank that entered more than a peer waits for that
peer, wherever its main thread stands: on NCCL or HCCL a collective returns at once and its rank blocks later, at a
host sync, outside any collective's frame. The counts start again where the groups are built again (a repair).
"""

from __future__ import annotations

import array
import atexit
import faulthandler
import gc
import logging
import mmap
import os
import signal
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from collections import namedtuple
from typing import IO, Iterator, Mapping, Sequence

from ft_plugins.config import PROGRESS_VAR
from ft_plugins.features.hangs import (BETWEEN, DATA, DUMP, END, EVAL, GC, RECOVERY, SAVE,  # noqa: F401
                                       SECTIONS, SETUP, STEP)

log = logging.getLogger("ft_plugins.hangs")

STACKS_SIGNAL = signal.SIGUSR2
_HEAD = struct.Struct("<iQ")  # pid, the main thread's ident (names it in a faulthandler dump)
# reports so far, step, steps begun in this process, section; the last step that ended: its seconds, its begun
_BODY = struct.Struct("<QqqBdq")
_SIZE = _HEAD.size + _BODY.size
# per process group the rank entered collectives on: its key (the CRC-32 of its ranks; 0: a free slot), how many
_GROUP = struct.Struct("<IQ")
GROUP_SLOTS = 16  # groups counted per rank (Megatron's rank has fewer): one past them is not counted


# collections' namedtuple, not typing.NamedTuple: that compiles each field's annotation when the class is made
class Record(namedtuple("Record", ("pid", "thread", "seq", "step", "begun", "section", "lasted", "lasted_begun"),
                         defaults=(0.0, 0))):
    """One rank's last report: its process, its main thread, how many reports, the step and section; the last step
    that ended whole, its seconds and its ``begun`` (0: none yet)."""

    __slots__ = ()
    pid: int
    thread: int
    seq: int
    step: int
    begun: int
    section: int
    lasted: float
    lasted_begun: int

    @property
    def section_name(self) -> str:
        return SECTIONS[self.section] if self.section < len(SECTIONS) else f"section {self.section}"


class Reporter:
    """The writing side, in a worker: one mapped file."""

    def __init__(self, directory: str, rank: int) -> None:
        path = os.path.join(directory, str(rank))
        size = _SIZE + GROUP_SLOTS * _GROUP.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 0)  # a previous process's counts gone
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.seq, self.step, self.begun, self.section = 0, 0, 0, SETUP
        self.lasted, self.lasted_begun = 0.0, 0
        self._began_at: float | None = None  # when the current step began (None: none, or a fault cut it short)
        self._entered: dict[int, list[int]] = {}  # group key -> [its slot's offset, collectives entered]
        self._main = threading.main_thread().ident or 0
        _HEAD.pack_into(self._map, 0, os.getpid(), self._main)
        self._collected = SETUP  # the section a collection interrupted
        self.report(SETUP)
        gc.callbacks.append(self.collecting)
        atexit.register(gc.callbacks.remove, self.collecting)  # not into the interpreter's last collections
        self._stacks: IO[str] = open(stacks_path(directory, rank), "a")  # kept open: faulthandler writes to its fd
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)

    def report(self, section: int, step: int | None = None) -> None:
        """This rank is now in ``section`` (of ``step``, when given)."""
        if step is not None and section == STEP and step != self.step:
            now = time.monotonic()
            if self._began_at is not None:  # the previous step's end was not reported: it lasted until now
                self.lasted, self.lasted_begun = now - self._began_at, self.begun
            self.begun += 1
            self._began_at = now
        elif section == BETWEEN and self._began_at is not None:
            self.lasted, self.lasted_begun = time.monotonic() - self._began_at, self.begun
            self._began_at = None
        elif section in (DUMP, RECOVERY):  # a step a fault cut short waited for a peer: it teaches nothing
            self._began_at = None
        if step is not None:
            self.step = step
        self._publish(section)
        if section == RECOVERY and self._entered:  # the groups are built again: every rank counts from there
            self._map[_SIZE:] = bytes(GROUP_SLOTS * _GROUP.size)
            self._entered.clear()

    def _publish(self, section: int) -> None:
        self.seq += 1
        self.section = section
        _BODY.pack_into(self._map, _HEAD.size, self.seq, self.step, self.begun, section, self.lasted,
                        self.lasted_begun)

    def collecting(self, phase: str, info: Mapping[str, int]) -> None:
        """``gc``'s callback: a collection of the oldest generation on the main thread is reported while it runs."""
        if info["generation"] != 2 or threading.get_ident() != self._main:
            return
        if phase == "start":
            self._collected = self.section
            self._publish(GC)
        elif self.section == GC:
            self._publish(self._collected)

    def entered(self, key: int) -> None:
        """One more collective entered on the group ``key``."""
        slot = self._entered.get(key)
        if slot is None:
            if len(self._entered) == GROUP_SLOTS:
                return
            slot = self._entered[key] = [_SIZE + len(self._entered) * _GROUP.size, 0]
        slot[1] += 1
        _GROUP.pack_into(self._map, slot[0], key, slot[1])


_reporter: Reporter | None = None


def start(rank: int, env: Mapping[str, str] | None = None) -> bool:
    """Report to the launcher named in the environment, once per process; False where none watches. Never raises."""
    global _reporter
    directory = (os.environ if env is None else env).get(PROGRESS_VAR, "")
    if _reporter is not None or not directory:
        return _reporter is not None
    try:
        _reporter = Reporter(directory, rank)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("hangs: rank %d cannot report its progress to the launcher (%s: %s); it is not watched",
                    rank, type(exc).__name__, exc)
        return False
    return True


def report(section: int, step: int | None = None) -> None:
    """Tell the launcher where this rank stands; nothing where no launcher watches."""
    if _reporter is not None:
        _reporter.report(section, step)


@contextmanager
def within(section: int) -> Iterator[None]:
    """Report ``section`` for the time of the block, then the section it interrupted again (a save or an
    evaluation between steps)."""
    if _reporter is None:
        yield
        return
    before = _reporter.section
    _reporter.report(section)
    try:
        yield
    finally:
        _reporter.report(before)


def entered(key: int) -> None:
    """Count one more collective this rank entered on the process group ``key`` (:func:`group_key`); nothing where
    no launcher watches."""
    if _reporter is not None:
        _reporter.entered(key)


def group_key(ranks: Sequence[int]) -> int:
    """A process group's key, the same on each of its members: the CRC-32 of its global ranks (never 0)."""
    return zlib.crc32(array.array("q", ranks).tobytes()) or 1


def stacks_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{rank}.stacks")


def read(directory: str, rank: int) -> Record | None:
    """A rank's last report (None: nothing readable yet); read twice so a report written meanwhile is not torn."""
    try:
        with open(os.path.join(directory, str(rank)), "rb") as file:
            first, second = file.read(_SIZE), os.pread(file.fileno(), _SIZE, 0)
    except OSError:
        return None
    if len(first) != _SIZE or first != second:
        return None
    return Record(*_HEAD.unpack_from(first), *_BODY.unpack_from(first, _HEAD.size))


def collectives(directory: str, rank: int) -> dict[int, int]:
    """How many collectives a rank entered, per process group key (empty: none counted, or nothing readable)."""
    size = GROUP_SLOTS * _GROUP.size
    try:
        with open(os.path.join(directory, str(rank)), "rb") as file:
            first, second = os.pread(file.fileno(), size, _SIZE), os.pread(file.fileno(), size, _SIZE)
    except OSError:
        return {}
    if len(first) != size or first != second:
        return {}
    slots = (_GROUP.unpack_from(first, index * _GROUP.size) for index in range(GROUP_SLOTS))
    return {key: count for key, count in slots if key}
