"""Real msrun jobs of ``fixtures/msrun_train.py`` (2 CPU workers, data parallel, 24 steps, a save every 4),
and what they leave: per-step losses, final parameters, checkpoints, process ids."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from support import PYTHON, free_port, kill_tree

from ft_plugins.processes import alive

MSRUN = str(Path(PYTHON).with_name("msrun"))
SCRIPT = Path(__file__).resolve().parent / "fixtures" / "msrun_train.py"
STEPS = 24
WORKERS = 2
SAVE_EVERY = 4  # the fixture's ModelCheckpoint saves at every 4th step
# the hangs bounds of the fixture's jobs: a step bound of 3 s (steps take about 0.1 s), a second of grace
HANG_BOUNDS = {"FT_PLUGINS_HANGS_FLOOR": "3", "FT_PLUGINS_HANGS_WARMUP": "60", "FT_PLUGINS_HANGS_STALL": "3",
               "FT_PLUGINS_HANGS_GRACE": "1"}


@dataclass
class Job:
    root: Path  # the checkpoint root: rank_0/, rank_1/
    out: Path
    logs: Path
    process: subprocess.Popen | None = None
    returncode: int | None = None
    stdout: str = ""
    signalled: float | None = None  # the wall time the test sent the launcher SIGTERM at
    output: str = "msrun.out"  # the launcher's output, beside ``out``

    def steps(self, rank: int) -> list[int]:
        return [record["step"] for record in self._records(rank)]

    def losses(self, rank: int) -> dict[int, float]:
        return {record["step"]: record["loss"] for record in self._records(rank)}

    def began(self, rank: int) -> dict[int, float]:
        """Each step's wall time at its begin, from the job's own step log."""
        return {record["step"]: record["began"] for record in self._records(rank)}

    def durations(self, rank: int) -> list[tuple[int, float]]:
        """(step, seconds) of each step ``rank`` ended, in order, from the job's own step log."""
        return [(record["step"], record["ended"] - record["began"]) for record in self._records(rank)]

    def killed(self, rank: int) -> float:
        """The wall time ``rank`` SIGKILLed itself at (``FT_TEST_KILL``)."""
        return float((self.out / f"killed_{rank}").read_text())

    def _records(self, rank: int) -> list[dict]:
        path = self.out / f"steps_{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def final(self, rank: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"final_{rank}.npz") as data:
            return dict(data)

    def error(self, rank: int) -> str:
        path = self.out / f"error_{rank}.txt"
        return path.read_text() if path.exists() else ""

    def log(self, rank: int) -> str:
        return (self.logs / f"worker_{rank}.log").read_text(errors="replace")


def job_env(**extra: str) -> dict[str, str]:
    """The installed ft_plugins in every worker; msrun starts workers with the first ``python`` on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_TEST", "MS_"))}
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    env.update(GLOG_v="2", **extra)
    return env


def ft_run(grace: float | None) -> tuple[str, ...]:
    """``ft-plugins run`` before the launcher, giving the workers ``grace`` seconds before SIGKILL (None: the grace
    it plans, which follows what the workers report their dump needs)."""
    return (PYTHON, "-m", "ft_plugins.cli", "run", *(("--grace", f"{grace:g}") if grace is not None else ()), "--")


def msrun_command(job: Job, program: tuple[str, ...], launcher: tuple[str, ...] = (),
                  node: tuple[int, int] | None = None) -> list[str]:
    """msrun of every worker on this node, or (``node``: its rank and the master's port) of one worker per node."""
    if node is None:
        placement = [f"--local_worker_num={WORKERS}", f"--master_port={free_port()}"]
    else:
        placement = ["--local_worker_num=1", f"--node_rank={node[0]}", "--master_addr=127.0.0.1",
                     f"--master_port={node[1]}"]
    return [*launcher, MSRUN, f"--worker_num={WORKERS}", *placement, f"--log_dir={job.logs}", "--join=True", *program]


def start(workdir: Path, form: str, env: dict[str, str], root: Path | None = None,
          launcher: tuple[str, ...] = (), program: tuple[str, ...] = (), node: tuple[int, int] | None = None) -> Job:
    """An msrun job in its own session (the test can end what is left of it), not waited for: SCRIPT in
    ``form``, or ``program`` (a script and its arguments, which leaves its processes' ids in ``workdir/out``);
    ``node``: this msrun is one node of the job (:func:`msrun_command`), its log and output named after it."""
    workdir.mkdir(parents=True, exist_ok=True)
    suffix = "" if node is None else str(node[0])
    job = Job(root or workdir / "ckpt", workdir / "out", workdir / f"logs{suffix}", output=f"msrun{suffix}.out")
    program = program or (str(SCRIPT), str(job.root), str(job.out), form)
    with open(workdir / job.output, "w") as output:  # a file: processes msrun orphans may hold it open
        job.process = subprocess.Popen(msrun_command(job, program, launcher, node), env=env, cwd=workdir,
                                       stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return job


def wait(job: Job, timeout: float = 240, faulted: bool = False) -> Job:
    """Until msrun ends; ``faulted``: or until every worker has exited, then msrun and its scheduler are
    ended (after a worker's failure msrun SIGKILLs the others, then waits ~30 s for its scheduler to time
    the lost node out: nothing of the test happens in that time)."""
    deadline = time.monotonic() + timeout
    while job.process.poll() is None:
        workers = [pid for pid, role in processes(job).items() if role == "MS_WORKER"]
        if time.monotonic() > deadline or (faulted and len(workers) == WORKERS and not any(map(alive, workers))):
            kill_tree(job.process.pid)  # msrun (or ft-plugins run and its msrun), its scheduler and its log tails
            if time.monotonic() > deadline:
                job.process.wait()
                raise AssertionError(f"msrun job timed out after {timeout} s:\n{launcher_output(job)[-3000:]}")
        time.sleep(0.1)
    job.returncode = job.process.returncode
    job.stdout = launcher_output(job)
    return job


def launcher_output(job: Job) -> str:
    """What the launcher (msrun, or ``ft-plugins run`` and its msrun) printed so far."""
    return (job.out.parent / job.output).read_text(errors="replace")


def copy_root(root: Path, target: Path) -> Path:
    """A job's checkpoint root copied for a relaunch, writable (MindSpore writes checkpoints read-only)."""
    shutil.copytree(root, target)
    for path in target.rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)
    return target


def latest_step(root: Path) -> tuple[int | None, int | None]:
    """(epoch, step in epoch) of the checkpoint ``resume`` would pick for rank 0."""
    from ft_plugins.checkpoint import find_latest

    selection = find_latest(root, rank=0)
    return selection.epoch, selection.step


def run(workdir: Path, form: str, env: dict[str, str], root: Path | None = None, faulted: bool = False,
        launcher: tuple[str, ...] = ()) -> Job:
    return wait(start(workdir, form, env, root, launcher), faulted=faulted)


def wait_for_step(job: Job, rank: int, step: int, timeout: float = 120) -> None:
    """Until ``rank`` has ended ``step`` (its step log says so), or the job ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.process.poll() is None:
        if job.steps(rank) and job.steps(rank)[-1] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never ended step {step}: {job.steps(rank)[-3:]}")


class Control:
    """A hang with the framework alone, looked at ``held`` seconds after ``reached(job)`` (which waits for the stuck
    rank's last step and returns its wall time), then ended from outside with all its processes (msrun's workers
    run in sessions of their own): which workers were alive, each rank's steps (``steps(job, rank)``), and every
    line ft_plugins logged."""

    def __init__(self, job: Job, reached: Callable[[Job], float], steps: Callable[[Job, int], list[int]],
                 held: float) -> None:
        self.job, self.alive, self.steps, self.lines = job, {}, [], []
        self.thread = threading.Thread(target=self._look, args=(reached, steps, held), daemon=True)
        self.thread.start()

    def _look(self, reached: Callable[[Job], float], steps: Callable[[Job, int], list[int]], held: float) -> None:
        try:
            time.sleep(max(0.0, reached(self.job) + held - time.time()))
            self.alive = {pid: alive(pid) for pid, role in processes(self.job).items() if role == "MS_WORKER"}
            self.steps = [steps(self.job, rank) for rank in range(WORKERS)]
            self.lines = [line for rank in range(WORKERS) for line in self.job.log(rank).splitlines()
                          if "ft_plugins" in line]
        finally:
            kill_tree(self.job.process.pid)
            self.job.process.wait()


def hang_found(job: Job, rank: int) -> tuple[str, str]:
    """The one line in which msrun's watch (under ``ft-plugins run``, said at start) names ``rank`` hung, and what
    follows it: its stacks first."""
    assert "hangs watched by msrun: a step max(" in job.stdout, job.stdout[-3000:]
    found = [line for line in job.stdout.splitlines() if f"hangs: rank {rank} (pid" in line]
    assert len(found) == 1, job.stdout[-4000:]
    return found[0], job.stdout.split(found[0], 1)[1]


def assert_step_bound(job: Job, bound: float) -> None:
    """``bound``, the step bound msrun's watch named a hang with (said to 0.1 s), is what the watch's rule gives for
    the steps the job's step log shows: ``max(floor, factor x the slowest step)``, the rule and its warm-up steps as
    said at start, each process's first steps teaching nothing. The watch times a step from the round that sees it
    begin to the round that sees it end, ``INTERVAL`` apart: as the log's step, give or take a round at either end.
    The log's step ends after ModelCheckpoint's step end: a save step is longer there than the watch's, so save
    steps raise the upper end only."""
    from ft_plugins.launch.msrun_watch import INTERVAL

    rule = re.search(r"a step max\(([0-9.]+) s, ([0-9.]+) x the slowest step\), set-up, the first (\d+) steps",
                     job.stdout)
    assert rule, job.stdout[-3000:]
    floor, factor, warmup = float(rule.group(1)), float(rule.group(2)), int(rule.group(3))
    taught = [(step, seconds) for rank in range(WORKERS) for begun, (step, seconds) in enumerate(job.durations(rank), 1)
              if begun > warmup]
    slack = 2 * INTERVAL
    low = max(floor, factor * (max(seconds for step, seconds in taught if step % SAVE_EVERY) - slack))
    high = max(floor, factor * (max(seconds for _, seconds in taught) + slack))
    assert low - 0.05 <= bound <= high + 0.05, (bound, low, high, taught)


def assert_same_parameters(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    """Every parameter (weights, momentum, global step, learning rate) equal bit for bit."""
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and left[name].tobytes() == right[name].tobytes(), name


def processes(job: Job) -> dict[int, str]:
    """pid -> MS_ROLE of every process that ran the script (scheduler and workers)."""
    found = {}
    for path in job.out.glob("pid_*"):
        role, _, pid = path.name[len("pid_"):].rpartition("_")
        found[int(pid)] = role
    return found


def log_tails(job: Job) -> list[int]:
    """The ``tail -f`` processes msrun started to show the workers' logs, still running."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == b"tail" and any(str(job.logs).encode() in arg for arg in argv):
            found.append(int(name))
    return [pid for pid in found if alive(pid)]
