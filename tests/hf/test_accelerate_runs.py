"""Real Accelerate jobs in successive processes (automatic checkpoint naming, ``total_limit=1``): a job
killed inside ``save_state`` keeps the previous checkpoint, and the next process loads it and saves;
stock Accelerate deletes the previous checkpoint first and leaves an empty folder for the next ``load_state()``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import torch
from hf_runs import FT_PLUGINS

from support import PYTHON, REPO

from ft_plugins.checkpoint import verify

JOB = Path(__file__).resolve().parent / "fixtures" / "accelerate_job.py"


def _job(project: Path, *args: str, ft: bool, fault: str = "") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    env = {**clean, "PYTHONPATH": str(REPO), "FT_PLUGINS": "resume" if ft else "none",
           **({"FT_PLUGINS_INJECT_FAULT": fault} if fault else {})}
    return subprocess.run([FT_PLUGINS, "run", "--", PYTHON, str(JOB), str(project), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def _equal(first: Path, second: Path) -> bool:
    a, b = torch.load(first), torch.load(second)
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_a_job_killed_inside_save_state_keeps_its_previous_checkpoint(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert _job(first, ft=True).returncode == 0
    checkpoints = first / "checkpoints"
    assert verify(checkpoints / "checkpoint_0").intact
    shutil.copy(first / "trained.pt", tmp_path / "saved.pt")
    stock, ft = tmp_path / "stock", tmp_path / "ft"
    for project in (stock, ft):
        shutil.copytree(first, project)
    # stock: the new process counts from 0 again and prunes checkpoint_0 before writing the new one into it;
    # all that is left is that empty folder, which the next stock load_state() takes
    killed = _job(stock, "--load", ft=False, fault="rank=0,step=0,kind=kill,at=save")
    assert killed.returncode != 0 and os.listdir(stock / "checkpoints") == ["checkpoint_0"]
    assert os.listdir(stock / "checkpoints" / "checkpoint_0") == []
    # ft_plugins: the counter continues from disk (checkpoint_1); nothing pruned before the new save is committed
    killed = _job(ft, "--load", ft=True, fault="rank=0,step=1,kind=kill,at=save")
    assert killed.returncode != 0 and "firing injected fault" in killed.stderr, killed.stderr[-3000:]
    assert verify(ft / "checkpoints" / "checkpoint_0").intact
    resumed = _job(ft, "--load", ft=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipped {ft / 'checkpoints' / 'checkpoint_1'}" in resumed.stderr
    assert _equal(ft / "loaded.pt", tmp_path / "saved.pt")
    assert sorted(os.listdir(ft / "checkpoints")) == ["checkpoint_2"] and verify(ft / "checkpoints" / "checkpoint_2").intact
