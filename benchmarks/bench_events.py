"""Per-step cost of the job's events (``ft-plugins report``'s record), against the same step unrecorded, in one run.

The step is the stand-in of ``bench_step_overhead.py`` (megatron's ``train_step`` signature, one batch, then
~5 ms of computing); with ``FT_PLUGINS_EVENTS_DIR`` set, ``enable()`` wraps it as it wraps the real one: a clock
read and a line kept in memory per step, written every few seconds. The two variants run interleaved in rounds;
the empty step's figure is the fastest round. Prints the added microseconds per step (on an empty step), what
they are of a ~5 ms step, and the median of the rounds' ratios of step times on it (goal: below 1.005).

Then the same ~5 ms step recorded into a folder on a slow file system (every write of the events file answers after
:data:`SLOW_WRITE` seconds, as a loaded shared file system may), against the bare step, in rounds of
:data:`SLOW_ROUND` seconds (each holds the writes of the steps every ``events.FLUSH_EVERY`` seconds): the median of
the rounds' ratios (goal: below 1.005).

    python benchmarks/bench_events.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step_overhead import WORK_SECONDS, _install_stand_ins, _make_step, _options, _time_steps  # noqa: E402

SLOW_WRITE = 0.05  # seconds each write of the events file takes on the slow file system
SLOW_ROUND = 10.0  # seconds of steps per round there
SLOW_ROUNDS = 3


def _slow_file_system(fd: int) -> None:
    """Every write to ``fd`` answers after :data:`SLOW_WRITE` seconds (this process's other writes as they were)."""
    real = os.write

    def write(target: int, data: bytes) -> int:
        if target == fd:
            time.sleep(SLOW_WRITE)
        return real(target, data)

    os.write = write


def main() -> None:
    options = _options(__doc__)
    training = _install_stand_ins()
    training.train = lambda *args, **kwargs: None
    os.environ.update(FT_PLUGINS_LOG="error", RANK="0")
    import ft_plugins.torch as ft_torch
    from ft_plugins import events

    folders = {"bare": "off", "recorded": tempfile.mkdtemp(prefix="bench-events-")}
    steps = {}
    for name, folder in folders.items():
        os.environ["FT_PLUGINS_EVENTS_DIR"] = folder
        events._recorder = None  # a process of its own, as far as the events know
        for work in (0.0, WORK_SECONDS):
            ft_torch.disable()
            training.train_step = _make_step(work)
            ft_torch.enable("none")
            steps[(name, work)] = training.train_step
    ft_torch.disable()

    timings: dict[tuple[str, float], list[float]] = {key: [] for key in steps}
    for round_number in range(options.rounds):
        order = list(steps.items())
        for (name, work), step in order[::-1] if round_number % 2 else order:  # neither variant always first
            timings[(name, work)].append(_time_steps(step, options.steps // 10 or 1 if work else options.steps * 10))
    fastest = {key: min(values) for key, values in timings.items()}
    added = fastest[("recorded", 0.0)] - fastest[("bare", 0.0)]
    ratios = sorted(recorded / bare for recorded, bare in zip(timings[("recorded", WORK_SECONDS)],
                                                               timings[("bare", WORK_SECONDS)]))
    print(f"empty step, bare: {fastest[('bare', 0.0)] * 1e6:.2f} us")
    print(f"recorded : +{added * 1e6:.2f} us per step (the wrapper, a clock read, a line kept), "
          f"{1 + added / WORK_SECONDS:.4f} of a {WORK_SECONDS * 1e3:.0f} ms step; measured on that step, the "
          f"median of the rounds' ratios: {ratios[len(ratios) // 2]:.4f}")

    os.environ["FT_PLUGINS_EVENTS_DIR"] = tempfile.mkdtemp(prefix="bench-events-slow-")
    events._recorder = None
    training.train_step = _make_step(WORK_SECONDS)
    ft_torch.enable("none")
    slow = training.train_step
    ft_torch.disable()
    _slow_file_system(events._recorder.fd)
    per_round = int(SLOW_ROUND / WORK_SECONDS)
    slow_ratios = []
    for round_number in range(SLOW_ROUNDS):  # neither variant always first
        order = [slow, steps[("bare", WORK_SECONDS)]]
        first, second = (_time_steps(step, per_round) for step in (order[::-1] if round_number % 2 else order))
        slow_ratios.append(second / first if round_number % 2 else first / second)
    print(f"recorded on a file system answering in {SLOW_WRITE * 1e3:.0f} ms: the median of {SLOW_ROUNDS} rounds' "
          f"ratios of {SLOW_ROUND:.0f} s of {WORK_SECONDS * 1e3:.0f} ms steps: {statistics.median(slow_ratios):.4f}")


if __name__ == "__main__":
    main()
