"""What a hung rank costs against a death of the same rank, on the 4-rank Megatron example (CPU, gloo, DP=4), in one
run: the time from the fault to training again, in place (``recover``), by ``ttp``'s dump and torchrun's restart, and
by NVIDIA's resiliency extension (NVRx) 0.4.1 on the same job.

Launches of ``examples/megatron_gpt/pretrain_gpt.py`` per round, with the same arguments; rank 1 either SIGKILLed
(a death) or stuck for good, deaf to SIGTERM (a hang), as the step after ``--fault`` completed steps begins:
  in place  ft-plugins run -- torchrun, FT_PLUGINS=ttp,recover,hangs        (a fresh replacement process joins)
  spare     the same with FT_PLUGINS_RECOVER_SPARES=1                       (a spare forked by the template takes over)
  restart   the same, FT_PLUGINS=ttp,resume,hangs, --max-restarts 1         (the survivors dump, torchrun restarts all
            four, they resume from the dump through --load)
  nvrx      NVRx's ft_launcher, --max-restarts 1, Megatron's own NVRx integration (``nvrx_worker.py``:
            --enable-ft-package --calc-ft-timeouts, its sections with the timeouts its docs give) and the timeouts it
            learned in a fault-free run of the job before (``ft_state.json``, as Megatron keeps them for the next
            run), a save at the fault's step that the restart loads (nothing trained again); installed on first use
            into .venv/nvrx-0.4.1 (pip)
ft_plugins' step bound is the floor (``--floor``; the learned 5 x the slowest step is below it here), the grace
before SIGKILL ``--grace``; ``--defaults``: neither set, ft_plugins' own defaults (a floor of 1 s; a batch, a
collection, a save and an evaluation bounded apart). A fault's time to training again comes from Megatron's
timestamped iteration lines: from the line of the last step completed before it to the line of the next step, less
one step (the fastest interval between two lines). Rounds alternate the runs, so machine noise hits all alike.
Prints each median, the ratio hang / death of each way and the goal a hang costs less than twice a death plus the
bound; with nvrx, each way's hang against NVRx's (goal: at most half).

``--stall S`` adds a run per way and round in which rank 1's data loader stalls ``S`` seconds at the same step and
the job goes on: healthy, so a way that ends it as a hang raised a false alarm (counted). ``--soak`` adds a run per
way and round of a healthy job with what real jobs have (:data:`SOAK`): slow first steps, a 2 s garbage collection,
a save every 5 steps, an evaluation every 10, a data loader that stalls 3 s; each alarm in it is a false one.

    python benchmarks/bench_hangs.py [--iters 30] [--fault 20] [--rounds 3] [--floor 3] [--grace 1] [--defaults]
                                     [--at forward|update|collective] [--stall 2] [--soak]
                                     [--ways "in place,spare,restart,nvrx"]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_recover import ITERATION, ROOT, SHAPES, _run, run_job  # noqa: E402

from ft_plugins.features.hangs import Hangs  # noqa: E402

WAYS = {"in place": {"FT_PLUGINS": "ttp,recover,hangs", "FT_PLUGINS_RECOVER_SPARES": "0"},
        "spare": {"FT_PLUGINS": "ttp,recover,hangs", "FT_PLUGINS_RECOVER_SPARES": "1"},
        "restart": {"FT_PLUGINS": "ttp,resume,hangs"},
        "nvrx": {"FT_PLUGINS": "none"}}  # ft_plugins' fire drill only
NVRX = ROOT / ".venv" / "nvrx-0.4.1"
NVRX_PACKAGES = ("nvidia-resiliency-ext==0.4.1", "nvidia-ml-py", "pynvml", "defusedxml")  # the rest is in .venv
NVRX_WORKER = Path(__file__).resolve().parent / "nvrx_worker.py"
# the section timeouts Megatron's NVRx integration documents (ft_integration.py), before any is learned
NVRX_SECTIONS = ("--ft-param-rank_section_timeouts=setup:600,step:180,checkpointing:420",
                 "--ft-param-rank_out_of_section_timeout=300")
KINDS = {"death": "kill", "hang": "stuck"}
# a hang found (one rank's, or every rank stalled alike), by ft_plugins / by NVRx
ALARMS = {False: ("made no progress for", "hangs: every rank"), True: ("FT timeout elapsed",)}
# a healthy job's pauses: slow first steps (every rank 4 s, then rank 0 2 s more: compilation, first batches), a 2 s
# garbage collection, a data loader that stalls 3 s; with a save every 5 steps and an evaluation every 10
SOAK = ";".join([*(f"rank={rank},step=0,kind=slow,seconds=4" for rank in range(4)), "rank=0,step=1,kind=slow,seconds=2",
                 "rank=2,step=12,kind=slow,at=gc,seconds=2", "rank=1,step=17,kind=slow,at=data,seconds=3"])
SOAK_ARGUMENTS = ("--save-interval", "5", "--eval-interval", "10", "--eval-iters", "2")


def to_training(output: str, completed: int) -> float:
    """Seconds from the fault in the step after ``completed`` steps to the next step's line (its last: after a
    restart), less one step."""
    times: dict[int, list[float]] = {}
    for stamp, step in ITERATION.findall(output):
        times.setdefault(int(step), []).append(datetime.fromisoformat(stamp).timestamp())
    step = min(times[n + 1][0] - times[n][-1] for n in times if n + 1 in times and times[n + 1][0] > times[n][-1])
    return times[completed + 1][-1] - times[completed][0] - step


def nvrx_run(workdir: Path, iters: int, fault: int, learned: Path, *extra: str, **env: str) -> str:
    """One run of the job under NVRx's ``ft_launcher`` (one restart allowed), saved at step ``fault``, with the
    timeouts ``learned`` (``ft_state.json``) where it exists, else learning them there (``extra``: Megatron
    arguments after these); its output."""
    if not (NVRX / "nvidia_resiliency_ext").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(NVRX),
                        *NVRX_PACKAGES], check=True)
    save = workdir / "ckpt"
    save.mkdir(exist_ok=True)
    if learned.exists():
        shutil.copy(learned, save / learned.name)
    ranks, arguments, shape_env = SHAPES["dp4"]
    command = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--nproc-per-node", str(ranks),
               "--standalone", "--max-restarts", "1", *NVRX_SECTIONS, str(NVRX_WORKER), *arguments,
               "--train-iters", str(iters), "--save", str(save), "--load", str(save), "--save-interval", str(fault),
               "--enable-ft-package", "--calc-ft-timeouts", *extra]
    output = run_job(command, workdir, {**shape_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}, (str(NVRX),))
    if not learned.exists():
        shutil.copy(save / learned.name, learned)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--fault", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", type=float, default=3.0, help="FT_PLUGINS_HANGS_FLOOR: the step bound here")
    parser.add_argument("--grace", type=float, default=1.0, help="FT_PLUGINS_HANGS_GRACE: SIGTERM to SIGKILL")
    parser.add_argument("--defaults", action="store_true", help="ft_plugins' own bounds: no --floor, no --grace")
    parser.add_argument("--stall", type=float, default=0.0,
                        help="also a run per way where rank 1's data loader stalls this many seconds, then goes on: a "
                             "healthy job, which no way may take for a hang")
    parser.add_argument("--at", default="forward", choices=("forward", "update", "collective"),
                        help="where rank 1 stops: as the step starts, inside the optimizer's update, or in a receive "
                             "no peer sends (every rank then waits, rank 1 missing from its peers' collective)")
    parser.add_argument("--soak", action="store_true",
                        help="also a run per way of a healthy job with slow first steps, a garbage collection, saves, "
                             "evaluations and a data loader stall, which no way may take for a hang")
    parser.add_argument("--ways", default="in place,spare,restart", help="a comma list of: " + ", ".join(WAYS))
    options = parser.parse_args()
    unknown = [way for way in options.ways.split(",") if way not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    ways = {way: WAYS[way] for way in options.ways.split(",")}
    bounds = {} if options.defaults else {"FT_PLUGINS_HANGS_FLOOR": str(options.floor),
                                          "FT_PLUGINS_HANGS_GRACE": str(options.grace)}
    healthy = {**({"stall": (f"rank=1,step={options.fault},kind=slow,seconds={options.stall:g},at=data", ())}
                  if options.stall else {}), **({"soak": (SOAK, SOAK_ARGUMENTS)} if options.soak else {})}
    faulty = {kind: (f"rank=1,step={options.fault},kind={fault},at={options.at}", ()) for kind, fault in KINDS.items()}
    runs = {**faulty, **healthy}
    times: dict[tuple[str, str], list[float]] = {(way, kind): [] for way in ways for kind in KINDS}
    alarms = {(way, kind): 0 for way in ways for kind in healthy}
    with tempfile.TemporaryDirectory() as learning:
        timeouts = Path(learning) / "ft_state.json"
        if "nvrx" in ways:  # the fault-free run that learns NVRx's timeouts
            nvrx_run(Path(learning), options.iters, options.fault, timeouts)
            print(f"nvrx timeouts learned: {timeouts.read_text()}", flush=True)
        for _ in range(options.rounds):
            for way, env in ways.items():
                for kind, (faults, extra) in runs.items():
                    drill = {**env, "FT_PLUGINS_INJECT_FAULT": faults}
                    with tempfile.TemporaryDirectory() as tmp:
                        output = (nvrx_run(Path(tmp), options.iters, options.fault, timeouts, *extra, **drill)
                                  if way == "nvrx" else
                                  _run(Path(tmp), "dp4", options.iters, way == "restart", *extra, **drill, **bounds)[1])
                    said = [line for line in output.splitlines() if any(a in line for a in ALARMS[way == "nvrx"])]
                    alarmed = bool(said)
                    if kind in healthy:
                        alarms[way, kind] += alarmed
                        print(f"{way:8s} {kind}: {'ended as a hang: ' + said[0][:300] if said else 'no alarm'}",
                              flush=True)
                        continue
                    if kind == "hang" and not alarmed:
                        raise SystemExit(f"the hang was not found ({way}):\n{output[-3000:]}")
                    times[way, kind].append(to_training(output, options.fault))
                    print(f"{way:8s} {kind:5s} to training again {times[way, kind][-1]:6.2f} s", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    floor = next(option.default for option in Hangs.options if option.name == "floor") if options.defaults \
        else options.floor
    bound = "ft_plugins' defaults" if options.defaults else f"step bound {floor:g} s, grace {options.grace:g} s"
    print(f"\nmedians of {options.rounds} rounds, {bound}:")
    for way in ways:
        death, hang = median[way, "death"], median[way, "hang"]
        line = f"{way}: death {death:.2f} s, hang {hang:.2f} s, hang / death {hang / death:.2f}"
        if way != "nvrx":
            goal = 2 * death + floor
            line += (f"; goal hang < 2 x death + bound = {goal:.2f} s: {'met' if hang < goal else 'NOT met'} "
                     f"(hang / goal {hang / goal:.2f})")
            if "nvrx" in ways:
                line += (f"; against NVRx's hang {hang / median['nvrx', 'hang']:.2f} (goal at most 0.5: "
                         f"{'met' if hang <= median['nvrx', 'hang'] / 2 else 'NOT met'})")
        for kind in healthy:
            line += f"; {kind} runs taken for a hang: {alarms[way, kind]} of {options.rounds}"
        print(line)


if __name__ == "__main__":
    main()
