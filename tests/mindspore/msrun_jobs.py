"""Real msrun jobs of ``fixtures/msrun_train.py`` (2 CPU workers, data parallel, 24 steps, a save every 4),
and what they leave: per-step losses, final parameters, checkpoints, process ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from support import PYTHON, REPO, free_port

MSRUN = str(Path(PYTHON).with_name("msrun"))
SCRIPT = Path(__file__).resolve().parent / "fixtures" / "msrun_train.py"
STEPS = 24
WORKERS = 2
# the scheduler gives up on a lost worker after this many seconds (MindSpore's default 30), so that msrun,
# which waits for it after killing the survivors, ends a faulted job within seconds
NODE_TIMEOUT = "10"


@dataclass
class Job:
    root: Path  # the checkpoint root: rank_0/, rank_1/
    out: Path
    logs: Path
    process: subprocess.Popen | None = None
    returncode: int | None = None
    stdout: str = ""

    def steps(self, rank: int) -> list[int]:
        return [record["step"] for record in self._records(rank)]

    def losses(self, rank: int) -> dict[int, float]:
        return {record["step"]: record["loss"] for record in self._records(rank)}

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
    """This tree's ft_plugins in every worker; msrun starts workers with the first ``python`` on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_TEST", "MS_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    env.update(MS_NODE_TIMEOUT=NODE_TIMEOUT, GLOG_v="2", **extra)
    return env


def msrun_command(job: Job, form: str, launcher: tuple[str, ...] = ()) -> list[str]:
    return [*launcher, MSRUN, f"--worker_num={WORKERS}", f"--local_worker_num={WORKERS}",
            f"--master_port={free_port()}", f"--log_dir={job.logs}", "--join=True", str(SCRIPT),
            str(job.root), str(job.out), form]


def start(workdir: Path, form: str, env: dict[str, str], root: Path | None = None,
          launcher: tuple[str, ...] = ()) -> Job:
    """An msrun job in its own session (the test can end what is left of it), not waited for."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = Job(root or workdir / "ckpt", workdir / "out", workdir / "logs")
    job.process = subprocess.Popen(msrun_command(job, form, launcher), env=env, cwd=workdir, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    return job


def wait(job: Job, timeout: float = 240) -> Job:
    try:
        job.stdout, _ = job.process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.process.pid, signal.SIGKILL)
        job.stdout, _ = job.process.communicate()
        raise AssertionError(f"msrun job timed out after {timeout} s:\n{job.stdout[-3000:]}") from None
    job.returncode = job.process.returncode
    return job


def run(workdir: Path, form: str, env: dict[str, str], root: Path | None = None, timeout: float = 240) -> Job:
    return wait(start(workdir, form, env, root), timeout)


def wait_for_step(job: Job, rank: int, step: int, timeout: float = 120) -> None:
    """Until ``rank`` has ended ``step`` (its step log says so), or the job ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.process.poll() is None:
        if job.steps(rank) and job.steps(rank)[-1] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never ended step {step}: {job.steps(rank)[-3:]}")


def assert_same_parameters(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    """Every parameter (weights, momentum, global step, learning rate) equal bit for bit."""
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and left[name].tobytes() == right[name].tobytes(), name
