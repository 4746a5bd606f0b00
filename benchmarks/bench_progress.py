"""Per-step cost of ``hangs``' progress reports, against the same step unreported, in one run.

The step is the stand-in of ``bench_step_overhead.py`` (megatron's ``train_step`` signature, one batch, then
~5 ms of computing); ``enable("hangs")`` wraps it as it wraps the real one, reporting into a mapped file in a
progress directory as under ``ft-plugins run -- torchrun``. The two variants run interleaved in rounds; each
figure is the fastest round. Prints the added microseconds per step (on an empty step) and the ratio of step
times on the ~5 ms step.

    python benchmarks/bench_progress.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step_overhead import WORK_SECONDS, _install_stand_ins, _make_step, _time_steps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    options = parser.parse_args()

    training = _install_stand_ins()
    training.train = lambda *args, **kwargs: None  # hangs wraps the loop too (the end of training)
    os.environ.update(FT_PLUGINS_LOG="error", RANK="0", FT_PLUGINS_PROGRESS=tempfile.mkdtemp(prefix="bench-progress-"))
    import ft_plugins.torch as ft_torch

    variants = {}
    for name in ("bare", "reported"):
        for work in (0.0, WORK_SECONDS):
            ft_torch.disable()
            training.train_step = _make_step(work)
            if name == "reported":
                ft_torch.enable("hangs")
                assert hasattr(training.train_step, "__wrapped__"), "hangs did not wrap the step"
            variants[(name, work)] = training.train_step
    ft_torch.disable()

    empty: dict[str, list[float]] = {"bare": [], "reported": []}
    loaded: dict[str, list[float]] = {"bare": [], "reported": []}
    for _ in range(options.rounds):
        for name in empty:
            empty[name].append(_time_steps(variants[(name, 0.0)], options.steps * 10))
            loaded[name].append(_time_steps(variants[(name, WORK_SECONDS)], options.steps // 10 or 1))

    added = min(empty["reported"]) - min(empty["bare"])
    ratio = min(loaded["reported"]) / min(loaded["bare"])
    print(f"empty step, bare: {min(empty['bare']) * 1e6:.2f} us")
    print(f"reported : +{added * 1e6:.2f} us per step (the step's and its batch's reports, and the wrappers); "
          f"ratio on a {WORK_SECONDS * 1e3:.0f} ms step: {ratio:.4f}")


if __name__ == "__main__":
    main()
