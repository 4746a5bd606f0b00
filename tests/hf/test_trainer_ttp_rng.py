"""The RNG files of the Trainer's dying gasp on real 3-rank torchrun runs (gloo, CPU) whose ranks' generators
drift apart (fixtures/drift_train.py: dynamic padding under dropout, a per-token augmentation): rank 2 is
killed in step 6, the two survivors dump checkpoint-5. Each survivor's ``rng_state_{i}.pth`` must be what
the uninterrupted reference run's own save of step 5 holds for that rank; the lost rank's is a copy of the
writer's, and a line says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hf_runs import Job, run_trainer, same_rng

DRIFT = Path(__file__).resolve().parent / "fixtures" / "drift_train.py"
RANKS, STEP, LOST = 3, 5, 2
SURVIVORS = tuple(rank for rank in range(RANKS) if rank != LOST)


def _drift_job(workdir: Path, *args: str, **env: str) -> Job:
    return run_trainer(workdir, workdir / "out", "--steps", str(STEP + 1), *args, script=DRIFT, ranks=RANKS, **env)


@pytest.fixture(scope="module")
def drift_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Uninterrupted, saving step 5 the Trainer's own way: every rank writes its RNG file."""
    job = _drift_job(tmp_path_factory.mktemp("drift-reference"), "--save-steps", str(STEP), FT_PLUGINS="resume")
    assert job.returncode == 0, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def drift_dump(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The same run with rank 2 killed as step 6 starts (no periodic save of step 5): the survivors dump it."""
    job = _drift_job(tmp_path_factory.mktemp("drift-dump"), "--save-steps", str(STEP + 1),
                     FT_PLUGINS="resume,ttp", FT_PLUGINS_INJECT_FAULT=f"rank={LOST},step={STEP},kind=kill,at=forward")
    dumps = job.lines("dumped")
    assert job.returncode != 0 and len(dumps) == 1 and f"checkpoint-{STEP} in" in dumps[0], job.output[-4000:]
    return job


def _rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng_state_{rank}.pth"


def test_each_survivor_dumps_its_own_rng_state_of_the_dumped_step(drift_reference: Job, drift_dump: Job) -> None:
    saved, dumped = drift_reference.checkpoint(STEP), drift_dump.checkpoint(STEP)
    for rank, other in zip(range(RANKS), (1, 2, 0)):  # the ranks really drifted: every generator differs
        assert same_rng(_rng_file(saved, rank), _rng_file(saved, other)) == ["cpu", "numpy", "python"]
    for rank in SURVIVORS:
        assert same_rng(_rng_file(saved, rank), _rng_file(dumped, rank)) == [], f"rank {rank}"


def test_the_lost_ranks_rng_file_is_a_copy_of_the_writers_and_a_line_says_so(drift_dump: Job) -> None:
    (dumped,) = drift_dump.lines("dumped")
    writer = int(re.search(r"rank (\d+) dumped", dumped).group(1))  # type: ignore[union-attr]
    assert writer in SURVIVORS
    checkpoint = drift_dump.checkpoint(STEP)
    assert _rng_file(checkpoint, LOST).read_bytes() == _rng_file(checkpoint, writer).read_bytes()
    (said,) = drift_dump.lines("no RNG state came from")
    assert f"rank(s) {LOST} within" in said and f"checkpoint-{STEP} are copies of rank {writer}'s" in said
