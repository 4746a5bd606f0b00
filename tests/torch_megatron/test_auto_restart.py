"""One command, no relaunch: ``torchrun --max-restarts 1`` restarts the workers after an injected fault,
and the restarted workers resume from the dump through Megatron's own ``--load``.

The launch setting the README gives is part of what is tested: with torchrun's default static
rendezvous (and with ``c10d`` too) the workers share the agent's store across restarts, and torch
2.13 does not prefix its keys per attempt, so the restarted ranks read the dead workers' Gloo
addresses for every group after the default one (Megatron's data-parallel group first) and fail
with ``Gloo connectFullMesh failed ... Connection refused``. ``--standalone`` (a ``c10d``
rendezvous) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a fresh store.
"""

from __future__ import annotations

import pytest

from report_check import check_faults
from ttp_runs import ITERS, Job, run_job, same_as_reference

STEP = 3  # the fault fires in the step after 3 completed steps
RESTARTING = ("--standalone", "--max-restarts", "1")
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
FAULT = {"FT_PLUGINS_INJECT_FAULT": f"rank=1,step={STEP},kind=kill"}


def _one_command(tmp_path_factory: pytest.TempPathFactory, name: str, features: str) -> Job:
    """The whole job as a user launches it: ``--load`` and ``--save`` on the same directory from the start."""
    workdir = tmp_path_factory.mktemp(name)
    save = workdir / "ckpt"
    return run_job(workdir, "--load", str(save), "--save-interval", "100", save=save, launcher=RESTARTING,
                   FT_PLUGINS=features, **FAULT, **FRESH_STORE)


def _trained(job: Job, iteration: int) -> int:
    return len(job.lines(f"iteration        {iteration}/       {ITERS}"))


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _one_command(tmp_path_factory, "auto_restart", "ttp,resume")


def test_fault_dump_automatic_restart_and_resume_in_one_command(restarted: Job, reference: Job) -> None:
    assert restarted.returncode == 0, restarted.output[-4000:]
    assert len(restarted.lines("firing injected fault rank=1,step=3,kind=kill")) == 1, "once per job, not per attempt"
    assert restarted.lines(f"rank 0 dumped mp_rank_00 of iteration {STEP} in")
    assert (restarted.iteration(STEP) / "ft_manifest.json").is_file(), "the dump was committed"
    assert restarted.lines(f"loading checkpoint from {restarted.save} at iteration {STEP}")
    assert not restarted.lines("connectFullMesh failed")
    assert [_trained(restarted, i) for i in range(1, ITERS + 1)] == [1] * ITERS, "no step trained twice or skipped"
    assert restarted.tracker() == str(ITERS)
    assert same_as_reference(restarted, reference, STEP) == []
    assert same_as_reference(restarted, reference, ITERS, rng=False) == []  # after a resume: see differences()


def test_the_report_names_the_fault_met_by_dump_and_restart_under_plain_torchrun(restarted: Job) -> None:
    check_faults(restarted, [(1, "death", "dump + restart", STEP)])


def test_negative_control_the_same_restart_without_ft_plugins_trains_the_lost_steps_again(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    job = _one_command(tmp_path_factory, "auto_restart_control", "none")
    assert job.returncode == 0, job.output[-4000:]
    assert not job.lines("loading checkpoint from")
    assert [_trained(job, i) for i in range(1, STEP + 1)] == [2] * STEP, "all 3 completed steps lost and redone"
    assert job.tracker() == str(ITERS)
