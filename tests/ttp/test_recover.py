"""In-place recovery (``recover``) on real 4-rank torchrun runs of Megatron's ``pretrain()`` (CPU, gloo, DP=4),
launched as ``ft-plugins run -- torchrun ...``, each against the uninterrupted run.

One run carries two faults in sequence (rank 1 killed in forward after 2 completed steps, then rank 3
after 4), with one warm spare per node (``FT_PLUGINS_RECOVER_SPARES=1``): the spare started with the job
takes over rank 1; rank 3 is taken over by the refilled spare or, if it is still importing, by one new
process. The survivors keep their processes, and the job ends with exit 0 and a final save bit for bit the uninterrupted run's (RNG included), with no
checkpoint written or read on the way. A replacement that never joins: the survivors wait for the bound,
then ``ttp``'s dump of the last completed step is committed, each survivor saying why. Without
ft_plugins the same fault ends the job.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ttp_runs import DP4, ITERS, Job, committed_dump, run_supervised, same_as_reference

FAR = ("--save-interval", "100")
RECOVER = {"FT_PLUGINS": "ttp,recover"}
FIRST, SECOND = 2, 4  # the faults fire in the steps after 2 and after 4 completed steps
TWO_FAULTS = f"rank=1,step={FIRST},kind=kill;rank=3,step={SECOND},kind=kill"


def _run(workdir: Path, *args: str, **env: str) -> Job:
    """``ft-plugins run -- torchrun --nproc-per-node 4 ...`` on the Megatron example."""
    return run_supervised(workdir, DP4, *FAR, *args, **env)


def _catchers(job: Job, rank: int) -> list[str]:
    """The pid of every catch of a fault by ``rank``, in order."""
    return re.findall(rf"recover: rank {rank} \(pid (\d+)\) caught", job.output)


@pytest.fixture(scope="module")
def reference(dp4_reference: Job) -> Job:
    """Uninterrupted, without ft_plugins, saving every step (shared with the MindIO engine's recovery)."""
    return dp4_reference


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("recovered"), **RECOVER, FT_PLUGINS_INJECT_FAULT=TWO_FAULTS,
                FT_PLUGINS_RECOVER_SPARES="1")


def test_two_ranks_lost_in_turn_the_job_ends_with_exit_0_and_the_uninterrupted_runs_weights(
        recovered: Job, reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert len(recovered.lines("firing injected fault")) == 2
    assert recovered.tracker() == str(ITERS)
    assert same_as_reference(recovered, reference, ITERS) == []  # model, optimizer, scheduler, RNG, counters


def test_only_the_lost_worker_is_replaced_the_survivors_keep_their_processes(recovered: Job) -> None:
    assert len(_catchers(recovered, 0)) == len(_catchers(recovered, 2)) == 2
    assert len(set(_catchers(recovered, 0))) == len(set(_catchers(recovered, 2))) == 1, "same process both times"
    spare = re.search(r"rank 1 exited with code -9; warm spare pid (\d+)", recovered.output)
    assert spare and _catchers(recovered, 1) == [spare.group(1)], "the spare, as rank 1, survived the second fault"
    assert recovered.lines("rank 1 exited with code -9; warm spare pid"), "the spare started with the job took over"
    assert recovered.lines("rank 3 exited with code -9; warm spare pid") or \
        recovered.lines("rank 3 exited with code -9; replacement pid")
    assert len(recovered.lines("took over as generation") + recovered.lines("started as generation")) == 2
    assert not recovered.lines("closing signal"), "torchrun never signalled a worker"
    assert recovered.lines("rank 1 joined generation 1") and recovered.lines("rank 3 joined generation 2")
    assert recovered.lines(f"every rank stands at step {FIRST}, training continues at step {FIRST + 1}")
    assert recovered.lines(f"every rank stands at step {SECOND}, training continues at step {SECOND + 1}")


def test_no_checkpoint_written_or_read_on_the_way(recovered: Job) -> None:
    assert not recovered.lines("loading checkpoint"), "the replacements read nothing from disk"
    assert sorted(path.name for path in recovered.save.iterdir()) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert not recovered.lines("dumped"), "no dying-gasp dump"


def test_every_step_trained_once(recovered: Job) -> None:
    assert [len(recovered.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS


def test_a_replacement_that_never_joins_bounded_wait_then_the_dump_is_committed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job = _run(tmp_path_factory.mktemp("never_joins"), **RECOVER,
               FT_PLUGINS_RECOVER_TIMEOUT="15",
               FT_PLUGINS_INJECT_FAULT=f"rank=1,step={FIRST},kind=kill;rank=1,step=0,kind=hang,at=join,life=1")
    committed_dump(job, FIRST)
    for survivor in (0, 2, 3):
        assert job.lines(f"[ft_plugins.recover rank {survivor}] ERROR recover: generation 1 cannot recover: "
                         "the replacement did not come within 15 s; falling back to ttp's dump"), job.output[-4000:]
    assert job.lines("is not replaced: a second fault during recovery")
    assert same_as_reference(job, reference, FIRST) == []  # what a save at that step holds


def test_negative_control_without_ft_plugins_the_same_fault_ends_the_job(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = _run(tmp_path_factory.mktemp("recover_control"), FT_PLUGINS="none",
               FT_PLUGINS_INJECT_FAULT=f"rank=1,step={FIRST},kind=kill")
    assert job.returncode != 0
    assert job.tracker() is None, "nothing saved: every completed step lost"
    assert job.lines("closing signal SIGTERM"), "torchrun stopped every worker"
