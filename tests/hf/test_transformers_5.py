"""The Trainer features on the newest transformers (5.x, installed beside the suite's 4.57 by scripts/setup.sh),
real 2-rank torchrun runs. After 5.0 the Trainer rotates with ``trainer_utils.rotate_checkpoints`` (no
``Trainer._rotate_checkpoints``): ``resume`` was off there ("this layout is not supported"), so a damaged newest
checkpoint crashed the resume and the rotation could delete the only complete one. Here every damage is skipped
with its reason, nothing is rotated while a newer save is uncommitted, and the resumed run ends bit-identical
(model and optimizer) to the uninterrupted one. ``ttp``'s dump with transformers' own SIGTERM saver
(``enable_jit_checkpoint``) on: one saver acts (the dump), torchrun's restart from it ends bit-identical, and
``ft-plugins report`` reads the Trainer job's events. Rank 0 lost: rank 1 writes the whole dump."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hf_runs import Job, run_trainer, same_state
from support import NEWER_TRANSFORMERS, PYTHON, assert_agrees, path_first

from ft_plugins.checkpoint import verify
from ft_plugins.checkpoint.manifest import MANIFEST

NEWEST = {"PYTHONPATH": path_first(NEWER_TRANSFORMERS)}
ARGS = ("--steps", "10", "--save-steps", "2", "--limit", "2")
TIMED = Path(__file__).resolve().parent / "fixtures" / "timed_train.py"  # the example with its steps' times
# the newest release: its version, Trainer._rotate_checkpoints there, trainer_utils.rotate_checkpoints there
ROTATION = ("5.24.0", "False", "True")


def _on_newest(job: Job) -> None:
    """The job ended well with every feature it asked for on: none turned off for a missing internal."""
    assert job.returncode == 0, job.output[-3000:]
    assert not job.lines("is missing in transformers"), job.lines("is missing in transformers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("hf-newest-reference")
    job = run_trainer(workdir, workdir / "out", *ARGS, FT_PLUGINS="resume", **NEWEST)
    _on_newest(job)
    return job


def test_the_jobs_run_a_5x_release_that_rotates_outside_the_trainer() -> None:
    probe = ("import transformers, transformers.trainer as t, transformers.trainer_utils as u; print("
             "transformers.__version__, hasattr(t.Trainer, '_rotate_checkpoints'), hasattr(u, 'rotate_checkpoints'))")
    found = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=300,
                           env={**os.environ, **NEWEST})
    assert found.returncode == 0, found.stderr[-2000:]
    version, method, function = found.stdout.split()
    assert ROTATION == (version, method, function), found.stdout  # the newest rotates in trainer_utils


def test_rotation_commits_first_and_keeps_the_limit(reference: Job) -> None:
    kept = sorted(path.name for path in reference.out.glob("checkpoint-*"))
    assert kept == ["checkpoint-10", "checkpoint-8"], kept
    for name in kept:
        assert (reference.out / name / MANIFEST).exists() and verify(reference.out / name).intact


def test_damage_skipped_nothing_rotated_past_an_uncommitted_save_and_the_resume_is_bit_identical(
        reference: Job, tmp_path: Path) -> None:
    out = tmp_path / "damaged"
    shutil.copytree(reference.out, out)
    os.truncate(out / "checkpoint-10" / "model.safetensors", 1000)
    (out / "checkpoint-14").mkdir()  # a save that never finished
    resumed = run_trainer(tmp_path, out, *ARGS, FT_PLUGINS="resume", **NEWEST)
    _on_newest(resumed)
    for name, reason in (("checkpoint-14", "no model weights"),
                         ("checkpoint-10", "model.safetensors: 1000 bytes, the manifest says")):
        skips = resumed.lines(f"skipped {out / name}:")
        assert len(skips) == 1 and reason in skips[0], (name, skips)
    assert len(resumed.lines(f"using {out / 'checkpoint-8'} instead")) == 1
    assert same_state(reference.final, resumed.final) == []
    # checkpoint-10 written again and committed; stock rotation (limit 2) would have deleted checkpoint-8
    assert verify(out / "checkpoint-10").intact and (out / "checkpoint-8").exists()
    assert resumed.lines("no checkpoint rotated")


def test_dump_with_the_jit_saver_on_restart_bit_identical_and_the_report_names_the_fault(
        reference: Job, tmp_path: Path) -> None:
    """One launch, torchrun restarting the workers once: rank 1 SIGKILLed in forward of step 6, rank 0 dumps
    checkpoint-5, the restart resumes from it and ends bit-identical; ``ft-plugins report`` on the job's events
    (the Trainer's steps, saves and dump) names the fault, met by dump + restart, no step lost, and its time to
    training again agrees with the job's own step log: from rank 1's last step begin (its forward, killed) to the
    restarted workers' first."""
    out = tmp_path / "out"
    job = run_trainer(tmp_path, out, *ARGS, "--jit-checkpoint", launcher=("--standalone", "--max-restarts", "1"),
                      script=TIMED, FT_TEST_STEP_LOG=str(tmp_path), FT_PLUGINS="resume,ttp",
                      FT_PLUGINS_INJECT_FAULT="rank=1,step=5,kind=kill,at=forward",
                      FT_PLUGINS_EVENTS_DIR=str(out / "ft_events"), **NEWEST)
    _on_newest(job)
    dumps = job.lines("dumped")
    assert len(dumps) == 1 and "checkpoint-5 in" in dumps[0], job.output[-3000:]
    assert job.lines("enable_jit_checkpoint stands down")
    assert not job.lines("Starting JIT checkpointing")
    assert same_state(reference.final, job.final) == []
    found = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "report", str(out), "--json"], capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    report = json.loads(found.stdout)
    assert [(fault["rank"], fault["how"], fault["steps_lost"]) for fault in report["faults"]] == [
        (1, "dump + restart", 0)], report
    begins = [[json.loads(line) for line in (tmp_path / f"steps_{rank}.jsonl").read_text().splitlines()]
              for rank in (0, 1)]
    killed = [record["began"] for record in begins[1] if record["pid"] == begins[1][0]["pid"]][-1]
    again = max(next(record["began"] for record in records if record["pid"] != records[0]["pid"])
                for records in begins)
    assert_agrees(report["faults"][0]["to_training"], again - killed, report["faults"][0])
    assert report["faults"][0]["phases"]["dump"] > 0, report
    assert 0 < report["goodput_percent"] < 100


def test_rank_0_lost_rank_1_dumps_the_whole_checkpoint_and_the_restart_is_bit_identical(
        reference: Job, tmp_path: Path) -> None:
    """transformers 5's ``_save`` writes the model only on process 0: the dump's writer, rank 1 here, writes it as
    process 0 would (before, its dump failed and the job fell back to its last periodic save)."""
    job = run_trainer(tmp_path, tmp_path / "out", *ARGS, launcher=("--standalone", "--max-restarts", "1"),
                      FT_PLUGINS="resume,ttp", FT_PLUGINS_INJECT_FAULT="rank=0,step=5,kind=kill,at=forward", **NEWEST)
    _on_newest(job)
    dumps = job.lines("dumped")
    assert len(dumps) == 1 and "rank 1 dumped" in dumps[0] and "checkpoint-5 in" in dumps[0], job.output[-3000:]
    assert len(job.lines(f"newest checkpoint {tmp_path / 'out' / 'checkpoint-5'} is intact")) == 1, job.output[-6000:]
    assert same_state(reference.final, job.final) == []
