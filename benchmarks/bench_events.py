"""Per-step cost of the job's events (``ft-plugins report``'s record), against the same step unrecorded, in one run.

The step is the stand-in of ``bench_step_overhead.py`` (megatron's ``train_step`` signature, one batch, then
~5 ms of computing); with ``FT_PLUGINS_EVENTS_DIR`` set, ``enable()`` wraps it as it wraps the real one: a clock
read and a line kept in memory per step, written every few seconds. The two variants run interleaved in rounds;
the empty step's figure is the fastest round. Prints the added microseconds per step (on an empty step), what
they are of a ~5 ms step, and the median of the rounds' ratios of step times on it (goal: below 1.005).

    python benchmarks/bench_events.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step_overhead import WORK_SECONDS, _install_stand_ins, _make_step, _options, _time_steps  # noqa: E402


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


if __name__ == "__main__":
    main()
