"""Real 2-rank Accelerate jobs (torchrun, gloo) in successive launches (automatic checkpoint naming,
``total_limit=1``): a job whose rank 0 is killed inside ``save_state`` keeps the previous checkpoint, and the
next 2-rank job loads it and saves; stock Accelerate deletes the previous checkpoint before it writes the new
one, and the same kill leaves nothing for the next ``load_state()``. A finished job drains its gloo collectives
and destroys its process group at exit. ``ft-plugins report`` reads the three launches with ft_plugins as one job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch
from hf_runs import FT_PLUGINS

from support import PYTHON, TORCHRUN, free_port

from ft_plugins.checkpoint import verify

JOB = Path(__file__).resolve().parent / "fixtures" / "accelerate_job.py"


def _job(project: Path, *args: str, ft: bool, fault: str = "", processes: int = 2,
         features: str = "resume") -> subprocess.CompletedProcess:
    """One launch of the job (2 ranks unless told); output (stdout and stderr together) on stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    env = {**clean, "FT_PLUGINS": features if ft else "none",
           **({"FT_PLUGINS_INJECT_FAULT": fault} if fault else {}),
           # the events beside the checkpoints, copied with them; the launches with ft_plugins: one job, relaunched
           "FT_PLUGINS_EVENTS_DIR": str(project / "ft_events"), "FT_PLUGINS_EVENTS_JOB": "accelerate-relaunched"}
    command = [FT_PLUGINS, "run", "--", TORCHRUN, "--nproc-per-node", str(processes), "--master-port", str(free_port()),
               str(JOB), str(project), *args]
    return subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def _equal(first: Path, second: Path) -> bool:
    a, b = torch.load(first), torch.load(second)
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_a_rank_killed_inside_save_state_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    first = tmp_path / "first"
    saved = _job(first, ft=True)
    assert saved.returncode == 0, saved.stdout[-3000:]
    checkpoints = first / "checkpoints"
    assert verify(checkpoints / "checkpoint_0").intact
    assert {f"random_states_{rank}.pkl" for rank in (0, 1)} <= set(os.listdir(checkpoints / "checkpoint_0"))
    # the finished gloo job's exit drain (ft_plugins.torch.hf.clean_exit): on each rank the process group was
    # destroyed before the job's own last exit handler ran
    for rank in (0, 1):
        assert json.loads((first / f"exit-{rank}.json").read_text()) == {"process_group_up": False}, rank
    shutil.copy(first / "trained.pt", tmp_path / "saved.pt")
    stock, ft = tmp_path / "stock", tmp_path / "ft"
    for project in (stock, ft):
        shutil.copytree(first, project)
    # stock: the new job counts from 0 again and rank 0 deletes checkpoint_0 before anything of the new save is
    # written; then either the kill fires as rank 0 starts writing into a new checkpoint_0, or rank 1 found
    # the old checkpoint_0 before rank 0 deleted it and refused ("already exists"). No model is left for the
    # next stock load_state()
    killed = _job(stock, "--load", ft=False, fault="rank=0,step=0,kind=kill,at=save")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert "firing injected fault" in killed.stdout or "checkpoint_0 (0) already exists" in killed.stdout
    assert not [path for path in (stock / "checkpoints").rglob("*") if path.name.startswith(("model", "optimizer"))]
    # ft_plugins: the counter continues from disk (checkpoint_1); nothing pruned before the new save is committed
    killed = _job(ft, "--load", ft=True, fault="rank=0,step=1,kind=kill,at=save")
    assert killed.returncode != 0 and "firing injected fault" in killed.stdout, killed.stdout[-3000:]
    assert verify(ft / "checkpoints" / "checkpoint_0").intact
    assert not verify(ft / "checkpoints" / "checkpoint_1").intact
    resumed = _job(ft, "--load", ft=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert len([line for line in resumed.stdout.splitlines()
                if f"skipped {ft / 'checkpoints' / 'checkpoint_1'}" in line]) == 1  # rank 0 decides for both
    assert _equal(ft / "loaded.pt", tmp_path / "saved.pt")
    assert sorted(os.listdir(ft / "checkpoints")) == ["checkpoint_2"] and verify(ft / "checkpoints" / "checkpoint_2").intact
    # the report of the three launches: rank 0's death inside save_state, met by the relaunch, which trains again
    # the 2 steps whose save was lost (Accelerate numbers no steps: each launch counts its updates from 1)
    found = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "report", str(ft), "--json"], capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    report = json.loads(found.stdout)
    assert [(fault["rank"], fault["kind"], fault["how"], fault["steps_lost"], fault["steps_recomputed"])
            for fault in report["faults"]] == [(0, "death", "restart", 2, 2)], report
    assert 0 < report["faults"][0]["to_training"] < report["wall"], report
    assert report["badput"]["checkpoint saves"] > 0 and 0 < report["goodput_percent"] < 100, report


def test_a_save_of_2_processes_loaded_by_3_says_so_and_with_elastic_the_third_takes_rank_0s_generators(
        tmp_path: Path) -> None:
    """Accelerate's save by 2 processes loaded by 3 (torchrun's restart on a node more). With ``elastic`` the third
    process, which has no ``random_states_2.pkl``, loads rank 0's file: its generators are the ones rank 0 saved, as
    ``set_seed`` made every process's alike. Without it (``resume`` alone) the third keeps its start-up generators.
    Either way one line says that the global batch and the place in the data are the script's to keep."""
    saved = _job(tmp_path / "saved", ft=True)
    assert saved.returncode == 0, saved.stdout[-3000:]
    checkpoint = tmp_path / "saved" / "checkpoints" / "checkpoint_0"
    rank_0 = torch.load(checkpoint / "random_states_0.pkl", weights_only=False)["torch_manual_seed"]
    loaded = {}
    for features, rng in (("resume,elastic", "a process with no RNG file of its own loads random_states_0.pkl"),
                          ("resume", "a process with no RNG file of its own keeps its start-up generators")):
        project = tmp_path / features.replace(",", "-")
        shutil.copytree(tmp_path / "saved", project)
        job = _job(project, "--load", ft=True, processes=3, features=features)
        assert job.returncode == 0, job.stdout[-3000:]
        said = f"{project / 'checkpoints' / 'checkpoint_0'} was written by 2 processes, 3 load it: Accelerate keeps no"
        assert said in job.stdout and rng in job.stdout, job.stdout[-3000:]
        loaded[features] = [torch.load(project / f"rng-{rank}.pt") for rank in range(3)]
    assert all(torch.equal(state, rank_0) for state in loaded["resume,elastic"])
    assert torch.equal(loaded["resume"][0], rank_0) and not torch.equal(loaded["resume"][2], rank_0)
