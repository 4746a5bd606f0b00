"""What one lost rank costs on the real Megatron example (CPU, gloo): in place (``recover``) against ``ttp``'s dump
and a whole-job restart, each as run time minus an uninterrupted run's, in one run. Shapes (``--shape``): ``dp4``,
4 ranks, DP=4, fp32; ``tp2pp2dp2``, 8 ranks, TP=2 x PP=2 x DP=2, bf16, the distributed optimizer in 2 instances.

Launches of ``examples/megatron_gpt/pretrain_gpt.py`` per round, all under ``ft-plugins run --
torchrun`` with the same arguments and a SIGKILL of rank 1 as the step after ``--fault`` completed steps
begins; each way of meeting the fault against an uninterrupted run of the same configuration (the spare
template's start-up, torch and megatron imported on the cores the ranks train on, is a cost of keeping
spares, not of the fault: it is printed on its own line):
  in place  FT_PLUGINS=ttp,recover                               (a fresh replacement process joins)
  spare     the same with FT_PLUGINS_RECOVER_SPARES=1             (a spare forked by the template takes over;
            the template forks another in its place)
  restart   FT_PLUGINS=ttp,resume, --max-restarts 1              (the survivors dump, torchrun restarts all
            four workers, they resume from the dump through --load)
Rounds alternate the six runs, so machine noise hits all alike. Prints each fault's cost (median over
rounds) and the ratios in place / restart and spare / restart, twice: by the whole run's time, and by the
training loop's (Megatron's log of step 1 to that of the last step: every cost of the fault falls in it,
the start-up's noise does not); and, from the in-place runs' own lines, the time from the fault to every
rank standing at K again.

    python benchmarks/bench_recover.py [--shape dp4|tp2pp2dp2] [--iters 40] [--fault 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "megatron_gpt" / "pretrain_gpt.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
REPAIRED = re.compile(r"rank 0 repaired generation 1 in ([\d.]+) s")
# ranks, the example's arguments, the environment
SHAPES = {
    "dp4": (4, ("--micro-batch-size", "1", "--global-batch-size", "4"), {}),
    "tp2pp2dp2": (8, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16",
                      "--micro-batch-size", "1", "--global-batch-size", "4", "--use-distributed-optimizer",
                      "--num-distributed-optimizer-instances", "2"), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
}
ITERATION = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration +(\d+)/")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(workdir: Path, shape: str, iters: int, restarts: bool, *extra: str, **env: str) -> tuple[float, str]:
    """One run of the example (``extra``: Megatron arguments after the benchmark's own); seconds and output."""
    save = workdir / "ckpt"
    ranks, arguments, shape_env = SHAPES[shape]
    launcher = ["--standalone", "--max-restarts", "1"] if restarts else ["--master-port", str(free_port())]
    command = [sys.executable, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nproc-per-node", str(ranks), *launcher,
               str(EXAMPLE), *arguments, "--train-iters", str(iters),
               "--save", str(save), "--load", str(save), "--save-interval", str(10 * iters), *extra]
    if restarts:  # each attempt its own store (see docs/verified.md)
        shape_env = {**shape_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    started = time.monotonic()
    output = run_job(command, workdir, {**shape_env, **env})
    return time.monotonic() - started, output


def run_job(command: list[str], workdir: Path, env: dict[str, str], path: tuple[str, ...] = ()) -> str:
    """``command`` run in ``workdir`` with this process's environment less its ft_plugins and torchrun variables, plus
    ``env``, ``path`` and the repository first on ``PYTHONPATH``; its output (stdout, then stderr). A failed run
    ends the benchmark with its tail, its whole output kept in a file the message names."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "TORCHELASTIC"))}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, str(ROOT), clean.get("PYTHONPATH", "")]))
    result = subprocess.run(command, cwd=workdir, env={**clean, **env}, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        kept = Path(tempfile.mkdtemp(prefix="failed_run_")) / "output.txt"
        kept.write_text(output)
        raise SystemExit(f"a run failed ({env}; its whole output: {kept}):\n{output[-3000:]}")
    return output


def training_loop(output: str, iters: int) -> float:
    """Seconds from Megatron's log of step 1 to its log of the last step (a restart's attempts included): the
    run without its start-up, whose length varies by +-1.5 s here and, with spares, by the template's import
    on the same cores."""
    logged = {}
    for stamp, step in ITERATION.findall(output):
        logged.setdefault(int(step), []).append(datetime.fromisoformat(stamp))
    return (max(logged[iters]) - min(logged[1])).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dp4")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--fault", type=int, default=30, help="late enough that the spare template finished importing")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    fault = {"FT_PLUGINS_INJECT_FAULT": f"rank=1,step={options.fault},kind=kill"}
    configurations = {"in place": {"FT_PLUGINS": "ttp,recover", "FT_PLUGINS_RECOVER_SPARES": "0"},
                      "spare": {"FT_PLUGINS": "ttp,recover", "FT_PLUGINS_RECOVER_SPARES": "1"},
                      "restart": {"FT_PLUGINS": "ttp,resume"}}
    measures = ("whole run", "training loop")
    times = {(measure, run, name): [] for measure in measures for run in ("clean", "fault") for name in configurations}
    repaired: dict[str, list[float]] = {"in place": [], "spare": []}
    for _ in range(options.rounds):
        for name, env in configurations.items():
            for run, extra in (("clean", {}), ("fault", fault)):
                with tempfile.TemporaryDirectory() as tmp:
                    elapsed, output = _run(Path(tmp), options.shape, options.iters, name == "restart",
                                           **env, **extra)
                loop = training_loop(output, options.iters)
                times["whole run", run, name].append(elapsed)
                times["training loop", run, name].append(loop)
                if extra and name in repaired:
                    repaired[name] += [float(value) for value in REPAIRED.findall(output)]
                late = (" (the spare template was still importing: a fresh process took over)"
                        if extra and name == "spare" and "warm spare pid" not in output else "")
                print(f"{name:9s} {run:5s} {elapsed:6.1f} s, training loop {loop:5.2f} s{late}", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    for measure in measures:
        cost = {name: median[measure, "fault", name] - median[measure, "clean", name] for name in configurations}
        print(f"\n{measure}, uninterrupted (median of {options.rounds}): " +
              ", ".join(f"{name} {median[measure, 'clean', name]:.2f} s" for name in configurations))
        keeping = median[measure, "clean", "spare"] - median[measure, "clean", "in place"]
        print(f"{measure}: keeping warm spares (the template's start-up), no fault: {keeping:+.2f} s")
        print(f"{measure}: a lost rank costs " + ", ".join(f"{name} {value:.2f} s" for name, value in cost.items()))
        print(f"{measure}: in place / dump + whole restart {cost['in place'] / cost['restart']:.2f}, "
              f"spare / dump + whole restart {cost['spare'] / cost['restart']:.2f}")
    for name, values in repaired.items():
        if values:
            print(f"{name}: rank 0 caught the fault to every rank standing at K again: median "
                  f"{statistics.median(values):.2f} s of {len(values)}")


if __name__ == "__main__":
    main()
