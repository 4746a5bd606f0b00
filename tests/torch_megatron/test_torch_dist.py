"""Megatron-LM's default checkpoint format, ``--ckpt-format torch_dist``, with ``ttp`` and ``recover`` (real torchrun
``pretrain()``, 2 ranks, gloo, DP=2).

A torch_dist save is one collective over every rank, so the survivors of a lost rank cannot write one: the dump
is written in the torch format (per-shard ``model_optim_rng.pt``), which Megatron's load tells apart by what the
directory holds, so the job's own ``--load`` with ``--ckpt-format torch_dist`` unchanged resumes from it; the
state saved keeps the job's format, so its later saves are torch_dist again. In-place recovery moves the state
in memory and is the same as with the torch format. Each run ends with the uninterrupted run's final torch_dist
save, model and optimizer (fp32 main parameters and moments) bit for bit; the same fault without ft_plugins
keeps no step after the last periodic save.
"""

from __future__ import annotations

import pytest

from ttp_runs import ITERS, Job, Launch, committed_dump, dist_differences, run_supervised

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

DIST = Launch(2, ("--ckpt-format", "torch_dist"))
FAR = ("--save-interval", "100")
STEP = 3
KILL = f"rank=1,step={STEP},kind=kill"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DIST.reference(tmp_path_factory.mktemp("dist_reference"), *FAR)  # the final save only


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DIST.run(tmp_path_factory.mktemp("dist_dumped"), *FAR, FT_PLUGINS="ttp,resume", FT_PLUGINS_INJECT_FAULT=KILL)


def test_the_survivor_dumps_the_last_completed_step_in_the_torch_format_and_commits_it(dumped: Job) -> None:
    committed_dump(dumped, STEP)
    assert (dumped.iteration(STEP) / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert not dumped.lines("engine is off for this run"), dumped.output[-3000:]


def test_the_jobs_own_load_resumes_and_its_later_saves_are_torch_dist_bit_identical(dumped: Job, reference: Job) -> None:
    resumed = DIST.resume(dumped, *FAR, FT_PLUGINS="ttp,resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"loading checkpoint from {resumed.save} at iteration {STEP}"), resumed.output[-3000:]
    assert [len(resumed.lines(f"iteration        {i}/       {ITERS}")) for i in range(STEP + 1, ITERS + 1)] \
        == [1] * (ITERS - STEP)
    final = resumed.iteration(ITERS)
    assert (final / ".metadata").is_file() and not (final / "mp_rank_00").exists(), "the final save is torch_dist"
    assert dist_differences(final, reference.iteration(ITERS), rng=False) == []


def test_negative_control_without_ft_plugins_the_fault_keeps_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = DIST.run(tmp_path_factory.mktemp("dist_bare"), *FAR, FT_PLUGINS="none", FT_PLUGINS_INJECT_FAULT=KILL)
    assert job.returncode != 0
    assert job.lines("firing injected fault"), job.output[-3000:]
    assert job.tracker() is None and not list(job.save.glob("iter_*")), "every step since the start is lost"


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("dist_recovered"), DIST, *FAR, FT_PLUGINS="ttp,recover",
                          FT_PLUGINS_INJECT_FAULT="rank=1,step=2,kind=kill")


def test_recover_replaces_the_lost_rank_in_place_and_ends_bit_identical(recovered: Job, reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert recovered.lines("recover: rank 1 joined generation 1"), recovered.output[-5000:]
    assert not recovered.lines("cannot be replaced") and not recovered.lines("loading checkpoint")
    assert [len(recovered.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS
    assert dist_differences(recovered.iteration(ITERS), reference.iteration(ITERS)) == []
