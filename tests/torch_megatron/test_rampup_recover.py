"""``recover`` under ``--rampup-batch-size`` (real 2-rank ``ft-plugins run -- torchrun`` ``pretrain()``, DP=2,
sample-based training as Megatron requires for a ramp-up), against the uninterrupted run; on megatron-core 0.19,
under ``--step-batch-size-schedule``, its replacement, with the same batches.

The global batch grows 2, 4, 6, 8 samples as samples are consumed, so the micro-batches a step reads change during
the run. A replacement used to count its way to the survivors' next sample with the number of micro-batches of the
run's start, reading and collating every batch from sample 0: it read the wrong samples. Now its counters are set
at the end of its set-up where the survivors stand, as a load sets them, and Megatron builds its data iterator at
the survivors' next sample. One run, two faults: rank 1 lost in forward during the ramp-up (every rank runs step 4
again), then rank 0 lost inside its own update of step 6 (its peer completed the step: the replacement starts a
step earlier with that step's batch size, and counts the step as done by its peer). The final save is the
uninterrupted run's bit for bit, consumed samples included.
"""

from __future__ import annotations

import re

import pytest

from ttp_runs import Job, Launch, differences, run_job, run_supervised



def _ramp_up() -> tuple[str, ...]:
    """The ramp-up as the installed megatron-core takes it. 0.19 still takes ``--rampup-batch-size`` but no longer
    ramps up; its ``--step-batch-size-schedule`` gives the same batches (thresholds in tokens: 32 per sample)."""
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("megatron-core")) >= Version("0.19"):
        return ("--step-batch-size-schedule", "0:2 192:4 448:6 640:8")
    return ("--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16")


RAMPUP = Launch(2, ("--micro-batch-size", "1", *_ramp_up()))
SAMPLES = ("--train-samples", "28")  # batches 2, 2, 2, 4, 4, 6, then 8: 7 steps
STEPS = 7
FAULTS = "rank=1,step=3,kind=kill;rank=0,step=5,kind=kill,at=update"
MODEL = "mp_rank_00/model_optim_rng.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    job = run_job(tmp_path_factory.mktemp("rampup_reference"), *RAMPUP.args, "--save-interval", "1",
                  nproc=RAMPUP.nproc, length=SAMPLES, FT_PLUGINS="none")
    assert job.returncode == 0, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("rampup_recovered"), RAMPUP, "--save-interval", "100",
                          length=SAMPLES, FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=FAULTS)


def test_the_batch_ramps_up_within_the_run(reference: Job) -> None:
    batches = [int(size) for size in re.findall(r"iteration +\d+/ +\d+ .*?global batch size: +(\d+)", reference.output)]
    assert batches == [2, 2, 2, 4, 4, 6, 8], batches


def test_each_replacement_joins_where_the_survivors_stand_and_the_run_ends_bit_identical(recovered: Job,
                                                                                       reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert len(recovered.lines("firing injected fault")) == 2
    assert recovered.lines("replacement of rank 1 (generation 1) starts at step 4, as the survivors")
    assert recovered.lines("replacement of rank 0 (generation 2) starts at step 6, as the survivors"), \
        recovered.output[-5000:]  # a step earlier than the survivors' next: it counts step 6 as done by rank 1
    assert [len(recovered.lines(f"iteration        {i}/       {STEPS}")) for i in range(1, STEPS + 1)] == [1] * STEPS
    final = f"iter_{STEPS:07d}"
    assert differences(recovered.save / final / MODEL, reference.save / final / MODEL) == []
