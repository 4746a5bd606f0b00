"""``recover`` on the flags production jobs pass, on real 2-rank ``ft-plugins run -- torchrun`` runs of
Megatron's ``pretrain()``, each against the uninterrupted run.

``--overlap-grad-reduce`` (26 of MindSpeed-LLM's example scripts): a rank lost in forward leaves its peer
waiting on the gradient all-reduce megatron started during backward; the broken wait left megatron's
``grad_reduce_handle`` set, and the redone step's ``start_grad_sync`` asserted it was None. The handle is
dropped when the loss is caught: the lost rank is replaced in place, exit 0, the uninterrupted run's weights
(overlapped or not, the reduction is the same sum, so the shared reference is the yardstick)."""

from __future__ import annotations

import pytest

from report_check import check_faults
from ttp_runs import ITERS, Job, Launch, run_supervised, same_as_reference

OVERLAPPED = Launch(2, ("--overlap-grad-reduce",))
STEP = 3


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("overlap_grad_reduce"), OVERLAPPED, "--save-interval", "100",
                          FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


def test_overlap_grad_reduce_a_rank_lost_in_forward_is_replaced_in_place(overlapped: Job, reference: Job) -> None:
    assert overlapped.returncode == 0, overlapped.output[-5000:]
    assert overlapped.lines("recover: rank 0 (pid"), "the survivor caught the loss"
    assert overlapped.lines(f"every rank stands at step {STEP}, training continues at step {STEP + 1}")
    assert not overlapped.lines("dumped"), "met in place, not by the dump"
    assert overlapped.tracker() == str(ITERS)
    assert same_as_reference(overlapped, reference, ITERS) == []


RESTARTS = ("--standalone", "--max-restarts", "3")
LOST, RAISED = 2, 4  # rank 1 killed after 2 steps (in place); rank 0's own exception after 4 (no one to replace)


@pytest.fixture(scope="module")
def restarting(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("recover_max_restarts")
    save = workdir / "ckpt"
    return run_supervised(workdir, Launch(2), "--save-interval", "100", "--load", str(save), launcher=RESTARTS,
                          FT_PLUGINS="ttp,recover,resume",
                          FT_PLUGINS_INJECT_FAULT=f"rank=1,step={LOST},kind=kill;rank=0,step={RAISED},kind=exception")


def test_max_restarts_in_place_first_then_the_whole_restart_torchrun_was_asked_for(restarting: Job,
                                                                                   reference: Job) -> None:
    assert restarting.returncode == 0, restarting.output[-6000:]
    assert restarting.lines("a failure it cannot repair in place restarts the whole job (--max-restarts 3)")
    assert not restarting.lines("the workers' store is not the agent's")
    assert restarting.lines(f"every rank stands at step {LOST}, training continues at step {LOST + 1}"), "in place"
    assert restarting.lines(f"dumped mp_rank_00 of iteration {RAISED} in"), "the exception fell back to the dump"
    assert restarting.lines("recover: torchrun restarted the whole job (attempt 2 of 4)")
    assert restarting.lines(f"loading checkpoint from {restarting.save} at iteration {RAISED}")
    assert not restarting.lines("connectFullMesh failed")
    assert restarting.tracker() == str(ITERS)
    assert same_as_reference(restarting, reference, ITERS, rng=False) == []  # after a resume: see differences()


def test_the_report_names_the_fault_met_in_place_and_the_one_met_by_dump_and_restart(restarting: Job) -> None:
    check_faults(restarting, [(1, "death", "in place", LOST), (0, "exception", "dump + restart", RAISED)])


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("recover_refused"), Launch(2), "--save-interval", "100",
                          "--use-distributed-optimizer", FT_PLUGINS="ttp,recover", FT_PLUGINS_TTP_REPLICAS="1",
                          FT_PLUGINS_INJECT_FAULT="rank=1,step=2,kind=kill")


def test_a_shape_recover_cannot_repair_is_refused_at_the_start_and_the_launcher_starts_no_replacement(
        refused: Job) -> None:
    """The distributed optimizer in one instance (replicas turned off): said once at the start; the launcher, told
    by the workers, leaves the lost rank to torchrun's own handling instead of starting a replacement that could
    not join."""
    why = ("megatron's distributed optimizer in one instance: a lost rank's optimizer shard has no other holder "
           "(FT_PLUGINS_TTP_REPLICAS=2, or --num-distributed-optimizer-instances 2)")
    assert len(refused.lines(f"recover: a lost rank cannot be replaced in this run: {why}")) == 1, refused.output[-4000:]
    assert refused.lines(f"is not replaced: the workers refused in-place recovery at the start ({why})")
    assert not refused.lines("replacement pid") and not refused.lines("cannot join"), "no second failure"
    assert refused.returncode != 0
