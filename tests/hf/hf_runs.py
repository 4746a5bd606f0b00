"""Real torchrun gloo runs of the Trainer example (examples/hf_trainer/train.py) and the bit-for-bit
comparison of their final model and optimizer state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support import FAKES, REPO, TORCHRUN, finish, free_port

EXAMPLE = REPO / "examples" / "hf_trainer" / "train.py"
FT_PLUGINS = str(Path(sys.executable).with_name("ft-plugins"))
STEPS = 12


@dataclass
class Job:
    returncode: int
    output: str
    out: Path
    final: Path

    def checkpoint(self, step: int) -> Path:
        return self.out / f"checkpoint-{step}"

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.output.splitlines() if needle in line]


def start_trainer(workdir: Path, out: Path, *args: str, ft: bool = True, fakes: bool = False,
                  launcher: tuple[str, ...] = (), script: Path = EXAMPLE, ranks: int = 2,
                  **env: str) -> tuple[subprocess.Popen, Path]:
    """The example (or another ``script`` taking its arguments) under ``ft-plugins run -- torchrun`` with
    ``ranks`` ranks (the launcher execs torchrun: the process is torchrun's); without ``ft`` with
    ``FT_PLUGINS=none`` (stock behaviour, fire drills armed). Output (stdout and stderr together) on the
    process's stdout; returns it and the final state's path."""
    final = workdir / f"final-{out.name}.pt"
    command = [FT_PLUGINS, "run", "--", TORCHRUN, "--nproc-per-node", str(ranks), "--master-port", str(free_port()),
               *launcher, str(script), str(out), "--final", str(final), *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    # a side directory holding another transformers release, first on every job's path (test_transformers_oldest.py)
    side = os.environ.get("FT_TEST_TRANSFORMERS_DIR")
    extra = {"PYTHONPATH": os.pathsep.join(str(path) for path in (side, FAKES if fakes else None) if path)}
    if not ft:
        extra["FT_PLUGINS"] = "none"
    process = subprocess.Popen(command, cwd=workdir, env={**clean, **extra, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    return process, final


def run_trainer(workdir: Path, out: Path, *args: str, timeout: int = 300, **options: object) -> Job:
    """:func:`start_trainer`, to its end; a job still running after ``timeout`` seconds is killed with its
    workers and fails the test."""
    process, final = start_trainer(workdir, out, *args, **options)  # type: ignore[arg-type]
    output, _ = finish(process, timeout)
    return Job(process.returncode, output, out, final)


def copy_checkpoints(source: Path, target: Path, *steps: int) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for step in steps:
        shutil.copytree(source / f"checkpoint-{step}", target / f"checkpoint-{step}")


def same_state(first: Path, second: Path) -> list[str]:
    """What differs between two final states (model tensors, optimizer state); empty: bit-identical."""
    import torch

    a, b = (torch.load(path, weights_only=False) for path in (first, second))
    differences = [f"step {a['step']} != {b['step']}"] if a["step"] != b["step"] else []
    differences += [f"model {name}" for name in a["model"] if not torch.equal(a["model"][name], b["model"][name])]
    for index, state in a["optimizer"]["state"].items():
        other = b["optimizer"]["state"].get(index, {})
        differences += [f"optimizer {index}.{key}" for key, value in state.items()
                        if key not in other or not torch.equal(value, other[key])]
    return differences


def same_rng(first: Path, second: Path) -> list[str]:
    """The generators whose state differs between two of the Trainer's RNG files; empty: the same state."""
    import torch

    a, b = (torch.load(path, weights_only=False) for path in (first, second))
    return sorted(name for name in a.keys() | b.keys() if name not in a or name not in b or not _same(a[name], b[name]))


def _same(first: object, second: object) -> bool:
    import numpy
    import torch

    if isinstance(first, (tuple, list)):
        return isinstance(second, (tuple, list)) and len(first) == len(second) and all(map(_same, first, second))
    if isinstance(first, (torch.Tensor, numpy.ndarray)):
        return type(first) is type(second) and bool(numpy.array_equal(numpy.asarray(first), numpy.asarray(second)))
    return first == second
