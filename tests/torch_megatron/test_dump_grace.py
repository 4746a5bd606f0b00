"""A dump slower than the launcher's grace, given its time by ``ft-plugins run``: a real 2-rank ``ft-plugins run --
torchrun --max-restarts 1`` run of Megatron's ``pretrain()`` whose rank 1 is killed after 3 steps while every
checkpoint write is slowed (a stalled file system) past torchrun's grace.

The job starts with nothing measured, so ``run`` plans torchrun's own grace; the periodic save of step 2 records
its slow write (``ft_write_speed.json``), and when rank 1 dies the torchrun process raises the grace to what that
write says a dump needs: the dump completes and is committed, and the relaunch resumes at step 3 and ends as the
uninterrupted run. The negative control, the same fault under plain torchrun, is ``dump_killed`` in
``test_builtin_engine.py``: rank 0 warned after the save, and torchrun's SIGKILL cut the dump short.

The clock is the suite's (``tests/fakes/slow_disk``): torchrun's fixed 30 s stop becomes 1 s, and each checkpoint
write of the first attempt takes 2 s more.
"""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from support import wait_gone
from ttp_runs import (ITERS, Job, Launch, children_started, end_children, probing_children, run_supervised,
                      same_as_reference, slow_disk)

STEP = 3  # rank 1 dies as the step after 3 completed steps begins
SLOW_WRITE, GRACE = 2, 1  # a write longer than torchrun's grace (its fixed 30 s, on the suite's clock)
RESTARTING = ("--standalone", "--max-restarts", "1")


def _trained(job: Job, iteration: int) -> int:
    return len(job.lines(f"iteration        {iteration}/       {ITERS}"))


@pytest.fixture(scope="module")
def given(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    workdir = tmp_path_factory.mktemp("dump_grace")
    env = {"FT_PLUGINS": "ttp,resume", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "FT_PLUGINS_INJECT_FAULT": f"rank=1,step={STEP},kind=kill", **slow_disk(SLOW_WRITE, GRACE)}
    yield run_supervised(workdir, Launch(2), "--load", str(workdir / "ckpt"), "--save-interval", "2",
                         launcher=RESTARTING, **probing_children(workdir / "children.txt", env))
    end_children(workdir / "children.txt")


def test_run_raises_the_grace_to_what_the_periodic_save_measured_and_the_dump_completes(given: Job) -> None:
    assert given.returncode == 0, given.output[-5000:]
    assert given.lines(f"no write measured yet in {given.save}"), given.output[-5000:]
    assert given.lines(f"the workers get {GRACE} s after SIGTERM before SIGKILL")
    raised = given.lines("measured on the save of iteration 2); the workers get")
    assert len(raised) == 1, given.output[-5000:]
    seconds = int(re.search(r"the workers get (\d+) s", raised[0]).group(1))
    assert seconds >= SLOW_WRITE * 1.5, raised[0]
    dumped = given.lines(f"rank 0 dumped mp_rank_00 of iteration {STEP} in")
    assert dumped, "the dump finished inside the grace"
    took = int(re.search(r" in (\d+) ms", dumped[0]).group(1))
    assert took >= SLOW_WRITE * 1000, f"the dump's write was not slowed as the save's was: {dumped[0]}"
    assert not given.lines("Unable to shutdown process"), "no SIGKILL"
    assert not given.lines("ttp: a dump needs about"), "under run the workers' grace follows the estimate: no warning"
    assert (given.iteration(STEP) / "ft_manifest.json").is_file(), "committed"


def test_the_relaunch_resumes_at_the_dumped_step_and_ends_bit_identical(given: Job, reference: Job) -> None:
    assert given.lines(f"loading checkpoint from {given.save} at iteration {STEP}")
    assert [_trained(given, i) for i in range(1, ITERS + 1)] == [1] * ITERS, "no step trained twice or skipped"
    assert given.tracker() == str(ITERS)
    assert same_as_reference(given, reference, STEP) == []
    assert same_as_reference(given, reference, ITERS, rng=False) == []  # after a resume: see differences()


def test_what_the_killed_rank_left_in_its_process_group_is_ended_before_the_restart(given: Job) -> None:
    """Each worker started a child that does not watch its parent (``fixtures/child_probe``). torchrun's own stop
    signals only the workers still running, so the killed rank 1's child would run on across the restart, holding
    its device's memory (left under plain torchrun: ``test_builtin_engine.py``). Under ``run`` it is ended at the
    stop, with rank 0's (SIGTERMed in its group)."""
    started = children_started(given.save.parent / "children.txt")
    assert sorted(rank for rank, _ in started) == ["0", "0", "1", "1"], started  # two attempts
    first_attempt = started[:2]
    assert sorted(rank for rank, _ in first_attempt) == ["0", "1"], started
    wait_gone([child for _, child in first_attempt], timeout=10)
