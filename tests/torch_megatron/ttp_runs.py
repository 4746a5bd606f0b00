"""Real torchrun gloo runs of the Megatron GPT example for the dying-gasp tests, and bit-for-bit comparison:
a dump of iteration K must equal the reference run's save of K in every tensor (model, optimizer,
scheduler, RNG) and counter."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import FAKES, MEGATRON_EXAMPLE, TORCHRUN, free_port, kill_running, path_first, read_records, run_to_end

ITERS = 6
CHILD_PROBE = Path(__file__).resolve().parent / "fixtures" / "child_probe"


@dataclass
class Job:
    returncode: int
    output: str
    save: Path

    def iteration(self, iteration: int) -> Path:
        return self.save / f"iter_{iteration:07d}"

    def tracker(self) -> str | None:
        path = self.save / "latest_checkpointed_iteration.txt"
        return path.read_text().strip() if path.exists() else None

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.output.splitlines() if needle in line]


def assert_no_step_logged_twice(job: Job) -> None:
    """After a repair by MindIO's handlers: no iteration logged twice, the last one logged. MindIO's stop reaches
    every survivor wherever it stands, the last rank too between a step's end and its log line, which is then never
    printed though the step was trained (the rollback says every rank stands at it). A step skipped shows in the
    final save, which each such test compares bit for bit with the uninterrupted run's."""
    logged = [len(job.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)]
    assert max(logged) == 1 and logged[-1] == 1, logged


def run_job(workdir: Path, *args: str, launcher: tuple[str, ...] = (), entry: Path = MEGATRON_EXAMPLE,
            save: Path | None = None, timeout: int = 300, nproc: int = 2,
            length: tuple[str, ...] = ("--train-iters", str(ITERS)), **env: str) -> Job:
    """torchrun with ``nproc`` ranks on the Megatron example, no vendor runtime on the path (MindIO absent);
    ``save`` defaults to ``workdir/ckpt``; ``length``: how long it trains."""
    save = save or workdir / "ckpt"
    command = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *launcher, str(entry),
               *length, "--save", str(save), *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    result = run_to_end(command, workdir, {**clean, **env}, timeout)
    return Job(result.returncode, result.stdout + result.stderr, save)


def run_supervised(workdir: Path, launch: "Launch", *args: str, launcher: tuple[str, ...] = (),
                   length: tuple[str, ...] = ("--train-iters", str(ITERS)), module: bool = False, **env: str) -> Job:
    """``ft-plugins run -- torchrun ...`` (the launcher that replaces a lost worker in place) on the Megatron example;
    ``launcher``: more of torchrun's own options; ``length``: how long it trains; ``module``: the example run as
    ``torchrun -m pretrain_gpt`` (its folder on the path), not as a script."""
    save = workdir / "ckpt"
    entry = ["-m", MEGATRON_EXAMPLE.stem] if module else [str(MEGATRON_EXAMPLE)]
    command = [sys.executable, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nproc-per-node", str(launch.nproc),
               "--master-port", str(free_port()), *launcher, *entry, *launch.args, *length, "--save", str(save), *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    if module:
        clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(MEGATRON_EXAMPLE.parent), clean.get("PYTHONPATH")]))
    result = run_to_end(command, workdir, {**clean, **dict(launch.env), **env}, timeout=400)
    return Job(result.returncode, result.stdout + result.stderr, save)


def probing_children(record: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job each of whose workers starts a child that does not watch its parent (``fixtures/child_probe``),
    recorded in ``record``: see :func:`children_started`."""
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHILD_PROBE), path])),
            "FT_TEST_CHILDREN": str(record)}


def children_started(record: Path) -> list[tuple[str, int]]:
    """(rank, child pid) of each child the workers of a :func:`probing_children` job started, in order."""
    return [(rank, int(child)) for rank, _, child in (line.split() for line in record.read_text().splitlines())]


def end_children(record: Path) -> None:
    """SIGKILL the children of a :func:`probing_children` job still running (those of workers that ended well: torch
    leaves them, as it would a user's)."""
    if record.exists():
        kill_running(child for _, child in children_started(record))


def slow_disk(write: float, grace: float, sync: float = 0.0) -> dict[str, str]:
    """A job's environment where every checkpoint write takes ``write`` seconds more in its first attempt (and the
    dump's sync after its commit ``sync`` more) and torchrun stops its workers with ``grace`` seconds, not its fixed
    30 (``tests/fakes/slow_disk``)."""
    return {"PYTHONPATH": path_first(FAKES / "slow_disk"), "FT_FAKE_SLOW_WRITE": str(write),
            "FT_FAKE_TORCHRUN_GRACE": str(grace), **({"FT_FAKE_SLOW_SYNC": str(sync)} if sync else {})}


def run_with_mindio(workdir: Path, launch: "Launch", *args: str, probes: tuple[Path, ...] = (),
                    **env: str) -> tuple[Job, list[dict[str, Any]]]:
    """``run_supervised`` with MindIO's stand-in on the path (ttp's MindIO engine, ARF on), and the calls it recorded;
    ``probes``: folders put before it on the path (e.g. ``fixtures/exit_probe``, which records into the same file).

    gloo's timeout is 2 minutes (Megatron's default 10): a survivor receiving a message that MindIO's stop cut
    mid-way waits it out (gloo leaves a half-received message's wait to its timeout, and has no abort), and the
    stand-in's controller gives a stopped rank 180 s to leave what it was in, as MindIO's does. On Ascend,
    ``stop_device`` ends HCCL's operations at once."""
    record = workdir / "mindio.jsonl"
    path = os.pathsep.join([*(str(probe) for probe in probes), path_first(FAKES)])
    job = run_supervised(workdir, launch, "--distributed-timeout-minutes", "2", *args, PYTHONPATH=path,
                         FT_FAKE_RECORD=str(record), TTP_ADDR="127.0.0.1", TTP_PORT=str(free_port()), **env)
    return job, read_records(record)


@dataclass(frozen=True)
class Launch:
    """The torchrun shape one module's runs share: ranks, Megatron arguments, environment."""

    nproc: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def run(self, workdir: Path, *args: str, save: Path | None = None, **env: str) -> Job:
        return run_job(workdir, *self.args, *args, save=save, nproc=self.nproc, **dict(self.env), **env)

    def resume(self, job: Job, *args: str, **env: str) -> Job:
        """Megatron's plain ``--load`` on ``job``'s save directory: a second launch of the same shape."""
        return self.run(job.save.parent, "--load", str(job.save), *args, save=job.save, **env)

    def preemption(self, completed: int, at: str = "") -> str:
        """The drill of a preemption: every rank SIGTERMed in the step after ``completed`` steps (``at``: where in it)."""
        where = f",at={at}" if at else ""
        return ";".join(f"rank={rank},step={completed},kind=term{where}" for rank in range(self.nproc))

    def reference(self, workdir: Path, *args: str) -> Job:
        """The uninterrupted run without ft_plugins, saving every step."""
        job = self.run(workdir, "--save-interval", "1", *args, FT_PLUGINS="none")
        assert job.returncode == 0, job.output[-3000:]
        return job


DP4 = Launch(4, ("--micro-batch-size", "1", "--global-batch-size", "4"))  # one rank per data-parallel replica
# megatron's argument check demands CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1
TP = Launch(4, ("--tensor-model-parallel-size", "2"), (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),))
SHARDS = ("mp_rank_00", "mp_rank_01")  # TP's shards: ranks 0 and 2 hold the first, ranks 1 and 3 the second


def differences(left: Path, right: Path, rng: bool = True) -> list[str]:
    """Every difference between two Megatron ``model_optim_rng.pt`` files in what a resume reads.

    ``rng=False`` leaves the RNG state out: after any resume, plain Megatron's own too, the CPU shim
    ends with another one (it maps the CUDA and model-parallel generators onto the CPU one).
    """
    import torch

    a, b = (torch.load(path, map_location="cpu", weights_only=False) for path in (left, right))
    found: list[str] = []
    for key in ("iteration", "model", "optimizer", "opt_param_scheduler", *(("rng_state",) if rng else ()),
                "num_floating_point_operations_so_far", "args"):
        _compare(a.get(key), b.get(key), key, found)
    return found


def dist_differences(left: Path, right: Path, rng: bool = True) -> list[str]:
    """Every difference between two torch_dist checkpoint directories of Megatron, each read whole into one state
    (``dcp_to_torch_save``): model, optimizer (its fp32 main parameters and moments), scheduler, counters;
    ``rng``: as in :func:`differences`."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, directory in enumerate((left, right)):
            dcp_to_torch_save(directory, f"{scratch}/{index}.pt")
            state = torch.load(f"{scratch}/{index}.pt", map_location="cpu", weights_only=False)
            if (directory / "common.pt").is_file():  # megatron-core < 0.19 keeps what is not sharded there
                state.update(torch.load(directory / "common.pt", map_location="cpu", weights_only=False))
            states.append({key: value for key, value in state.items() if rng or "rng" not in key})
    found: list[str] = []
    _compare(*states, "", found)
    if not any(key.startswith("optimizer") and torch.is_tensor(value) for key, value in states[0].items()):
        found.append("no optimizer tensors: nothing of the optimizer compared")
    return found


def _compare(a: Any, b: Any, where: str, found: list[str]) -> None:
    import numpy as np
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            found.append(f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}")
        for key in a.keys() & b.keys():
            _compare(a[key], b[key], f"{where}.{key}", found)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            found.append(f"{where}: length {len(a)} != {len(b)}")
        for index, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{where}[{index}]", found)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            found.append(f"{where}: tensors differ")
    elif isinstance(a, Namespace) and isinstance(b, Namespace):  # the run's arguments, its own paths among them
        for count in ("consumed_train_samples", "consumed_valid_samples"):  # what a resume reads of them
            _compare(getattr(a, count, None), getattr(b, count, None), f"{where}.{count}", found)
    elif isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):  # a torch_dist save's sharded objects
        if a.getvalue() != b.getvalue():
            found.append(f"{where}: objects differ")
    elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if not np.array_equal(a, b):
            found.append(f"{where}: arrays differ")
    elif a != b:
        found.append(f"{where}: {a!r} != {b!r}")


def same_as_reference(job: Job, reference: Job, iteration: int, rng: bool = True,
                      shard: str = "mp_rank_00") -> list[str]:
    model = f"{shard}/model_optim_rng.pt"
    return differences(job.iteration(iteration) / model, reference.iteration(iteration) / model, rng)


def committed_dump(job: Job, iteration: int) -> None:
    """The dump of ``iteration`` is committed: renamed, manifest, tracker, and ``ckpt verify`` agrees."""
    assert job.returncode != 0, "a fault must end the job"
    assert job.tracker() == str(iteration), job.output[-4000:]
    assert (job.iteration(iteration) / "ft_manifest.json").is_file()
    assert not list(job.save.glob("iter_*_tmp"))
    verify = subprocess.run([sys.executable, "-m", "ft_plugins.cli", "ckpt", "verify", str(job.iteration(iteration))],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert len(job.lines(f"mp_rank_00 of iteration {iteration} in")) == 1, "one writer for the one shard"


def resumed_to_the_end(resumed: Job, reference: Job, step: int) -> None:
    """A plain ``--load`` relaunch on the dump of ``step`` went on at ``step + 1`` and ended as the reference."""
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"loading checkpoint from {resumed.save} at iteration {step}")
    assert resumed.lines(f"iteration        {step + 1}/       {ITERS}")
    assert not resumed.lines(f"iteration        {step}/       {ITERS}")
    assert same_as_reference(resumed, reference, ITERS, rng=False) == []
