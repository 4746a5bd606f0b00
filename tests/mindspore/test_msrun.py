"""Real msrun jobs, 2 CPU workers, data parallel (``fixtures/msrun_train.py``: 24 steps, a save every 4),
written as the README's plain-MindSpore recipe shows, against the same job run uninterrupted.

Nothing is faked: msrun, its scheduler, MindSpore's Model.train, ModelCheckpoint and collectives, the
checkpoints on disk. A crash is rank 1 SIGKILLing itself right after a step ended.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import msrun_jobs
from msrun_jobs import STEPS, Job, assert_same_parameters, job_env

KILLED_AFTER = 14  # two steps after the save of step 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The job uninterrupted, MindSpore alone."""
    job = msrun_jobs.run(tmp_path_factory.mktemp("reference"), "plain", job_env())
    assert job.returncode == 0, job.stdout[-3000:]
    return job


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The job, MindSpore alone, rank 1 killed after step 14: saves of steps 4 to 12 on disk."""
    job = msrun_jobs.run(tmp_path_factory.mktemp("crashed"), "plain", job_env(FT_TEST_KILL=f"1,{KILLED_AFTER}"))
    assert job.returncode != 0 and job.steps(1)[-1] == KILLED_AFTER, job.stdout[-3000:]
    return job


def _copy(root: Path, target: Path) -> Path:
    shutil.copytree(root, target)
    for path in target.rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)  # MindSpore writes checkpoints read-only
    return target


@pytest.fixture(scope="module")
def resumed(crashed: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The README's recipe relaunched on the crashed job's checkpoints."""
    workdir = tmp_path_factory.mktemp("resumed")
    root = _copy(crashed.root, workdir / "ckpt")
    return msrun_jobs.run(workdir, "recipe", job_env(FT_PLUGINS="resume"), root=root)


def test_the_recipe_resumes_after_the_last_save_and_ends_bit_identical(reference: Job, crashed: Job,
                                                                        resumed: Job) -> None:
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    for rank in range(msrun_jobs.WORKERS):
        assert resumed.steps(rank) == list(range(13, STEPS + 1))  # the dataset skipped steps 9-12 of epoch 2
        expected = {step: loss for step, loss in reference.losses(rank).items() if step > 12}
        assert resumed.losses(rank) == expected
        assert_same_parameters(resumed.final(rank), reference.final(rank))


def test_the_resumed_saves_continue_the_cadence(reference: Job, resumed: Job) -> None:
    """ModelCheckpoint saves steps 16, 20 and 24 as the uninterrupted run did (under its renamed prefix)."""
    from mindspore import load_checkpoint

    saved = sorted(p.name for p in (resumed.root / "rank_0").glob("net_1-*.ckpt"))
    assert saved == ["net_1-2_8.ckpt", "net_1-3_4.ckpt", "net_1-3_8.ckpt"]
    for name in saved:
        ours = load_checkpoint(str(resumed.root / "rank_0" / name))
        theirs = load_checkpoint(str(reference.root / "rank_0" / name.replace("net_1", "net")))
        assert_same_parameters({k: v.asnumpy() for k, v in ours.items()}, {k: v.asnumpy() for k, v in theirs.items()})


def test_without_a_resume_dir_initial_epoch_refuses_naming_it(crashed: Job,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """``FaultTolerance()`` + ``initial_epoch(...)``: before, every epoch was trained again on the loaded step 12."""
    workdir = tmp_path_factory.mktemp("no_directory")
    job = msrun_jobs.run(workdir, "no_directory", job_env(FT_PLUGINS="resume"), root=_copy(crashed.root, workdir / "ckpt"))
    assert job.returncode != 0
    errors = [job.error(rank) for rank in range(msrun_jobs.WORKERS) if job.error(rank)]
    assert errors  # the first rank to fail ends the job: msrun kills the other wherever it stands
    for error in errors:
        assert error.startswith("ValueError: resume: initial_epoch() cannot know where the checkpoints are")
        assert "FaultTolerance(resume_dir=DIR)" in error
    assert [job.steps(rank) for rank in range(msrun_jobs.WORKERS)] == [[], []]  # nothing trained
