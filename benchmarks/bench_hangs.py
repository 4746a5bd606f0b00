"""What a hung rank costs against a death of the same rank, on the 4-rank Megatron example (CPU, gloo, DP=4), in one
run: the time from the fault to training again, in place (``recover``) and by ``ttp``'s dump and torchrun's restart.

Launches of ``examples/megatron_gpt/pretrain_gpt.py`` per round, all under ``ft-plugins run -- torchrun`` with
``hangs`` on and the same arguments; rank 1 either SIGKILLed (a death) or stuck for good, deaf to SIGTERM (a hang),
as the step after ``--fault`` completed steps begins:
  in place  FT_PLUGINS=ttp,recover,hangs                       (a fresh replacement process joins)
  spare     the same with FT_PLUGINS_RECOVER_SPARES=1            (a spare forked by the template takes over)
  restart   FT_PLUGINS=ttp,resume,hangs, --max-restarts 1      (the survivors dump, torchrun restarts all four,
            they resume from the dump through --load)
The step bound is the floor (``--floor``, the learned 5 x the slowest step is below it here), the grace before
SIGKILL ``--grace``. A fault's time to training again comes from Megatron's timestamped iteration lines: from the
line of the last step completed before it to the line of the next step, less one step (the fastest interval between
two lines). Rounds alternate the four runs, so machine noise hits all alike. Prints each median, the ratio hang /
death of each way, and the issue's goal: a hang costs less than twice a death plus the bound.

    python benchmarks/bench_hangs.py [--iters 30] [--fault 20] [--rounds 3] [--floor 3] [--grace 1]
                                     [--ways "in place,spare,restart"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_recover import ITERATION, _run  # noqa: E402

WAYS = {"in place": {"FT_PLUGINS": "ttp,recover,hangs", "FT_PLUGINS_RECOVER_SPARES": "0"},
        "spare": {"FT_PLUGINS": "ttp,recover,hangs", "FT_PLUGINS_RECOVER_SPARES": "1"},
        "restart": {"FT_PLUGINS": "ttp,resume,hangs"}}
KINDS = {"death": "kill", "hang": "stuck"}


def to_training(output: str, completed: int) -> float:
    """Seconds from the fault in the step after ``completed`` steps to the next step's line (its last: after a
    restart), less one step."""
    times: dict[int, list[float]] = {}
    for stamp, step in ITERATION.findall(output):
        times.setdefault(int(step), []).append(datetime.fromisoformat(stamp).timestamp())
    step = min(times[n + 1][0] - times[n][-1] for n in times if n + 1 in times and times[n + 1][0] > times[n][-1])
    return times[completed + 1][-1] - times[completed][0] - step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--fault", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", type=float, default=3.0, help="FT_PLUGINS_HANGS_FLOOR: the step bound here")
    parser.add_argument("--grace", type=float, default=1.0, help="FT_PLUGINS_HANGS_GRACE: SIGTERM to SIGKILL")
    parser.add_argument("--ways", default="in place,spare,restart", help="a comma list of: " + ", ".join(WAYS))
    options = parser.parse_args()
    unknown = [way for way in options.ways.split(",") if way not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    ways = {way: WAYS[way] for way in options.ways.split(",")}
    bounds = {"FT_PLUGINS_HANGS_FLOOR": str(options.floor), "FT_PLUGINS_HANGS_GRACE": str(options.grace)}
    times: dict[tuple[str, str], list[float]] = {(way, kind): [] for way in ways for kind in KINDS}
    for _ in range(options.rounds):
        for way, env in ways.items():
            for kind, fault in KINDS.items():
                with tempfile.TemporaryDirectory() as tmp:
                    _, output = _run(Path(tmp), "dp4", options.iters, way == "restart", **env, **bounds,
                                     FT_PLUGINS_INJECT_FAULT=f"rank=1,step={options.fault},kind={fault}")
                if kind == "hang" and "hangs: rank 1 (pid" not in output:
                    raise SystemExit(f"the hang was not found by the watchdog ({way}):\n{output[-3000:]}")
                times[way, kind].append(to_training(output, options.fault))
                print(f"{way:8s} {kind:5s} to training again {times[way, kind][-1]:6.2f} s", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"\nmedians of {options.rounds} rounds, step bound {options.floor:g} s, grace {options.grace:g} s:")
    for way in ways:
        death, hang = median[way, "death"], median[way, "hang"]
        goal = 2 * death + options.floor
        print(f"{way}: death {death:.2f} s, hang {hang:.2f} s, hang / death {hang / death:.2f}; "
              f"goal hang < 2 x death + bound = {goal:.2f} s: {'met' if hang < goal else 'NOT met'} "
              f"(hang / goal {hang / goal:.2f})")


if __name__ == "__main__":
    main()
