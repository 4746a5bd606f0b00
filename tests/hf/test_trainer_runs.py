"""Real 2-rank torchrun Trainer runs (gloo, CPU): commits, ranges and the TaskD worker in the reference run;
the rotation race with and without ft_plugins; every kind of damage skipped with its reason and the
resumed run ending bit-identical (model and optimizer) to the uninterrupted one."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import transformers
from transformers import Trainer

from hf_runs import STEPS, Job, copy_checkpoints, run_trainer, same_state
from support import read_records

from ft_plugins.checkpoint import verify
from ft_plugins.checkpoint.manifest import MANIFEST

# transformers 4.46 on: the Trainer fetches each step's batches in get_batch_samples, which mstx ranges
FETCHES = hasattr(Trainer, "get_batch_samples")
SAVE_KILL = ("--save-steps", "4", "--limit", "1")
KILL_RANK1_IN_SAVE_8 = "rank=1,step=8,kind=kill,at=save"
SLOW_MONITOR = ("--monitor-interval", "2")  # rank 0 finds the loss through its own collective, as on a big job


def test_reference_run_commits_every_save_ranges_each_optimizer_step_and_starts_taskd_once(reference: Job) -> None:
    for step in range(2, STEPS + 1, 2):
        checkpoint = reference.checkpoint(step)
        assert (checkpoint / MANIFEST).exists() and verify(checkpoint).intact, step
    records = read_records(reference.out.parent / "calls.jsonl")
    pids = {record["pid"] for record in records if record["rank"] is not None}
    assert len(pids) == 2
    for pid in pids:
        mine = [record for record in records if record["pid"] == pid]
        workers = [record["args"] for record in mine if record["api"] == "init_taskd_worker"]
        assert workers == [[int(mine[0]["rank"]), 5000, "pt"]]
        assert all(record["dist_initialized"] for record in mine if record["api"] == "init_taskd_worker")
        ranges = Counter(record["args"][0] for record in mine if record["api"] == "mstx.range_start")
        assert ranges == Counter({**{f"step {n}": 1 for n in range(STEPS)}, "save_checkpoint": STEPS // 2,
                                  **({"dataloader": STEPS} if FETCHES else {})})
    if not FETCHES:
        assert len(reference.lines(f"mstx: no dataloader ranges on transformers {transformers.__version__}")) == 1


def _stock_and_ft_rotation_race(tmp_path: Path) -> tuple[Job, Job]:
    jobs = []
    for ft in (False, True):
        workdir = tmp_path / ("ft" if ft else "stock")
        workdir.mkdir()
        jobs.append(run_trainer(workdir, workdir / "out", *SAVE_KILL, ft=ft, launcher=SLOW_MONITOR,
                                FT_PLUGINS_INJECT_FAULT=KILL_RANK1_IN_SAVE_8,
                                **({"FT_PLUGINS": "resume"} if ft else {})))
    return jobs[0], jobs[1]


def test_rotation_race_then_every_damage_kind_skipped_and_the_resume_is_bit_identical(
        reference: Job, tmp_path: Path) -> None:
    stock, ft = _stock_and_ft_rotation_race(tmp_path)
    for job in (stock, ft):
        assert job.returncode != 0 and job.lines("firing injected fault"), job.output[-3000:]
    # stock: rank 0 rotated while rank 1 had not written its part: the only complete checkpoint is gone
    assert not stock.checkpoint(4).exists()
    assert not (stock.checkpoint(8) / "rng_state_1.pth").exists()
    # ft_plugins: rotation waits for every rank and the commit; checkpoint-4 stays, committed
    assert (ft.checkpoint(4) / MANIFEST).exists() and verify(ft.checkpoint(4)).intact
    assert not (ft.checkpoint(8) / MANIFEST).exists()

    # one directory holding every kind of damage above the good checkpoint-4
    out = tmp_path / "damaged"
    shutil.copytree(ft.out, out)
    copy_checkpoints(reference.out, out, 6, 10, 12)
    (out / "checkpoint-6" / "checkpoint-is-incomplete.txt").write_text("")  # transformers v5's marker
    os.truncate(out / "checkpoint-10" / "model.safetensors", 1000)
    (out / "checkpoint-12" / "optimizer.pt").unlink()  # a file the save wrote (the manifest lists it)
    (out / "checkpoint-14").mkdir()
    shutil.copytree(reference.checkpoint(12), out / "tmp-checkpoint-16")
    resumed = run_trainer(tmp_path, out, "--save-steps", "2", "--limit", "2", FT_PLUGINS="resume",
                          FT_EXAMPLE_IMPORT="1")
    assert resumed.returncode == 0, resumed.output[-3000:]
    reasons = {
        "tmp-checkpoint-16": "save still in progress",
        "checkpoint-14": "no model weights",
        "checkpoint-12": "optimizer.pt: listed in the manifest but missing",
        "checkpoint-10": "model.safetensors: 1000 bytes, the manifest says",
        "checkpoint-8": "rng_state_1.pth missing",  # rank 1 was killed before writing its part
        "checkpoint-6": "checkpoint-is-incomplete.txt present",
    }
    for name, reason in reasons.items():
        skips = resumed.lines(f"skipped {out / name}:")
        assert len(skips) == 1 and reason in skips[0] and "rank 0" in skips[0], (name, skips)  # decided once
    assert len(resumed.lines(f"using {out / 'checkpoint-4'} instead")) == 1
    assert same_state(reference.final, resumed.final) == []
    # the saves (every 4 steps, as the resumed checkpoint-4 records) over damaged folders are committed again;
    # nothing was rotated while the newer checkpoint-14 is uncommitted
    for step in (8, 12):
        assert verify(out / f"checkpoint-{step}").intact, step
    assert (out / "checkpoint-4").exists() and resumed.lines("no checkpoint rotated")
