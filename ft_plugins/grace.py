"""How long a dying gasp takes, and the grace a launcher gives it before its SIGKILL.

A dump races the launcher's clock: torchrun SIGTERMs the survivors when a worker dies and SIGKILLs them
30 s later; a Kubernetes pod gets its ``terminationGracePeriodSeconds``. A dump still writing then is
lost. The time a dump needs is estimated from this job's own writes: every periodic save and every dump
records beside the checkpoints (:data:`RECORD` in the save directory, the last :data:`HISTORY` writes) how
many bytes its largest writer wrote and in how long; the estimate is the largest of those sizes at the
slowest speed recorded (a file system is not always as fast as last time), times :data:`MARGIN`, plus
:data:`FIXED` (freezing the step, gathering, the commit). From ten writes on, the slowest tenth is passed over
(:data:`OUTLIERS`): one save that met a stalled file system does not set the grace for the 31 after it. And a
grace estimated so never passes ``FT_PLUGINS_GRACE_MAX`` (:data:`ft_plugins.config.GRACE_MAX` by default): each
stop of the workers (torchrun's, msrun's, a pod's) waits the whole grace for a worker that does not end; the
lines that give the estimate say when the cap cut it. Framework-neutral: the glue says what was written and when.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from ft_plugins.checkpoint.atomic import atomic_file
from ft_plugins.checkpoint.manifest import MANIFEST, manifest_or_problem
from ft_plugins.checkpoint.parallel import each
from ft_plugins.config import GRACE_FOLLOWS_VAR, GRACE_MAX, GRACE_MAX_VAR, GRACE_VAR, ConfigError, grace_max
from ft_plugins.events import option

log = logging.getLogger("ft_plugins.grace")

RECORD = "ft_write_speed.json"
HISTORY = 32  # writes kept: enough to have met the file system's slow days, bounded so reading stays cheap
OUTLIERS = 10  # one write in this many recorded may have met a stall: the slowest len // OUTLIERS are passed over
MARGIN = 1.5  # a slower file system than measured, several nodes writing at once
FIXED = 5.0  # seconds a dump spends besides writing: the freeze, gathering the optimizer, the commit
TORCHRUN_GRACE = 30.0  # torch's elastic agent: SIGTERM to the survivors, SIGKILL 30 s later
SHUTDOWN_VAR = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's own setting for the stop on a signal
SHUTDOWN_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")


@dataclass(frozen=True)
class Measured:
    """One write of this job: ``written`` bytes by its largest writer in ``seconds``, and what it was."""

    written: int
    seconds: float
    what: str

    @property
    def speed(self) -> float:
        """Bytes per second one writer reached."""
        return self.written / max(self.seconds, 1e-3)


def record(save_dir: str, measured: Measured) -> None:
    """Add ``measured`` to the save directory's recent writes; a failure is logged, never raised into training.
    Writers recording at the same moment may drop one another's entry (each rename is whole): one write less."""
    _write(save_dir, [*recorded(save_dir), measured][-HISTORY:])


def report(directory: str, expected: Measured) -> None:
    """Put ``expected`` (a dump's size and time, worked out from a save directory's record) in ``directory`` as its
    only write: the launcher's grace follows it (``FT_PLUGINS_GRACE_FOLLOWS``)."""
    _write(directory, [expected])


def _write(directory: str, writes: list[Measured]) -> None:
    try:
        with atomic_file(os.path.join(directory, RECORD), durable=False) as handle:  # a hint: nothing to wait for
            json.dump({"writes": [asdict(write) for write in writes]}, handle)
    except OSError as exc:
        log.debug("grace: cannot record the write speed in %s: %s", directory, exc)


def measured(save_dir: str | None) -> Measured | None:
    """What the estimate rests on: the largest write recorded in ``save_dir`` at the slowest speed recorded once
    the slowest tenth is passed over (the 90th percentile of the time a byte took, nearest rank: with fewer than
    ten writes, the slowest); None when none was (or the record is unreadable)."""
    writes = recorded(save_dir) if save_dir else []
    if not writes:
        return None
    passed = len(writes) // OUTLIERS
    chosen = sorted(writes, key=lambda write: write.speed)[passed]
    if len(writes) == 1:
        return chosen
    largest = max(write.written for write in writes)
    rank = f"the {_ordinal(passed + 1)} slowest" if passed else "the slowest"
    outliers = "" if not passed else (" (the slowest passed over as an outlier)" if passed == 1 else
                                      f" (the {passed} slower passed over as outliers)")
    return Measured(largest, largest / chosen.speed,
                    f"{chosen.what}, {rank} of the {len(writes)} writes recorded{outliers}")


def _ordinal(count: int) -> str:
    suffix = "th" if 10 <= count % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(count % 10, "th")
    return f"{count}{suffix}"


def recorded(save_dir: str) -> list[Measured]:
    """The recorded writes, oldest first (a record of one write, as earlier releases kept, is read too)."""
    try:
        with open(os.path.join(save_dir, RECORD), "rb") as handle:
            data = json.loads(handle.read(1 << 20))
        entries = data["writes"] if isinstance(data, dict) and "writes" in data else [data]
        writes = [Measured(int(entry["written"]), float(entry["seconds"]), str(entry["what"])) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [write for write in writes if write.written > 0 and write.seconds >= 0]  # 0 bytes: nothing was found


def largest_writer(checkpoint: str) -> int:
    """The bytes the largest writer of a Megatron checkpoint directory wrote: one ``mp_rank_*`` directory
    (``torch`` format), else the largest file (``torch_dist``: one ``.distcp`` file per writer). From the save's
    commit manifest where ``resume`` has just written one (one read, where a stat of each file is a round trip to
    the metadata server: 10,000 of them at 10,000 ranks), else from the files."""
    committed = manifest_or_problem(os.path.join(checkpoint, MANIFEST))
    if isinstance(committed, dict):
        writers: dict[str, int] = {}
        for relative, entry in committed["files"].items():
            writer = relative.split("/")[0]  # a file of its own, or the mp_rank_* directory it lies in
            writers[writer] = writers.get(writer, 0) + entry["size"]
        return max(writers.values(), default=0)
    try:
        with os.scandir(checkpoint) as entries:
            found = list(entries)
        # each file's stat side by side where the file system makes it wait (torch_dist: a file per writer)
        return max(each(_size, found), default=0)
    except OSError:
        return 0


def _size(entry: os.DirEntry) -> int:
    """A file's bytes, or a ``mp_rank_*`` directory's files' together (0: anything else)."""
    if entry.is_dir(follow_symlinks=False):
        with os.scandir(entry.path) as inside:
            return sum(file.stat().st_size for file in inside if file.is_file(follow_symlinks=False))
    return entry.stat().st_size if entry.is_file(follow_symlinks=False) else 0


def estimate(state_bytes: int, speed: float, fixed: float = FIXED) -> float:
    """Seconds a dump of ``state_bytes`` per writer needs at ``speed`` bytes per second, with the margin;
    ``fixed``: the seconds it spends besides writing (none where the state is copied to host memory each step)."""
    return state_bytes / max(speed, 1.0) * MARGIN + fixed


def needed(found: Measured) -> float:
    return estimate(found.written, found.speed)


def cap() -> float:
    """The most seconds an estimated grace gives (``FT_PLUGINS_GRACE_MAX``); a malformed value, which the job's
    start refuses, is said here too where nothing refused it (``ft-plugins k8s``, ``doctor``): the default then."""
    try:
        return grace_max(os.environ)
    except ConfigError as exc:
        log.warning("%s; %g s used", exc, GRACE_MAX)
        return GRACE_MAX


def grace_for(found: Measured | None, default: float) -> float:
    """The grace that covers the dump the record predicts, up to :func:`cap`, never under the launcher's
    ``default``."""
    return default if found is None else max(default, min(cap(), float(math.ceil(needed(found)))))


def amount(count: float, unit: str = "B") -> str:
    """``count`` bytes (or bytes a second, ``unit="B/s"``) in the unit that shows it: 251 B, 3.4 MB, 425 MB/s,
    17.00 GB (a tiny state's dump is not "0.00 GB at 0 MB/s")."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            value = count / scale
            places = 2 if (prefix, unit) == ("G", "B") else 1 if value < 100 else 0
            return f"{value:.{places}f} {prefix}{unit}"
    return f"{count:.0f} {unit}"


def describe(found: Measured, capped: bool = True) -> str:
    """What a dump needs and what that rests on; ``capped``: and, where it is so, that the cap cuts the grace."""
    seconds, limit = needed(found), cap() if capped else math.inf
    cut = (f", more than {GRACE_MAX_VAR}={limit:g} s, the most an estimated grace gives: a dump that long is cut "
           f"short; raise {GRACE_MAX_VAR} where the file system is this slow") if seconds > limit else ""
    return (f"a dump needs about {seconds:.0f} s ({amount(found.written)} by its largest writer at "
            f"{amount(found.speed, 'B/s')}, measured on the {found.what}){cut}")


def worker_grace(env: Mapping[str, str]) -> tuple[float, str]:
    """The grace this worker's launcher gives it, and whose: ``ft-plugins run``'s, else torchrun's."""
    try:
        return float(env[GRACE_VAR]), "ft-plugins run's"
    except (KeyError, ValueError):
        return TORCHRUN_GRACE, "torchrun's"


def warn_if_short(save_dir: str | None, env: Mapping[str, str]) -> str | None:
    """The line a worker says when its launcher's grace is shorter than the dump needs (None: it is not)."""
    found = measured(save_dir)
    if found is None or GRACE_FOLLOWS_VAR in env:  # ft-plugins run raises the grace to the estimate
        return None
    grace, whose = worker_grace(env)
    if needed(found) <= grace:
        return None
    return (f"{describe(found, capped=False)}, longer than {whose} grace of {grace:g} s before SIGKILL: a dump then "
            f"is cut short; run under 'ft-plugins run' (it gives the workers that time, up to {GRACE_MAX_VAR}) or "
            "raise the grace")


def save_dir_of(command: Sequence[str]) -> str | None:
    """The ``--save`` directory a training command names (Megatron's argument, the last one given), if any."""
    return option(command, "--save")


def shutdown_given(command: Sequence[str], env: Mapping[str, str]) -> float | None:
    """The shutdown timeout a torchrun command sets itself (its flag, else its variable), if any."""
    given = option(command, *SHUTDOWN_FLAGS)
    if given is not None:
        return _seconds(given)
    return _seconds(env[SHUTDOWN_VAR]) if SHUTDOWN_VAR in env else None


def _seconds(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None
