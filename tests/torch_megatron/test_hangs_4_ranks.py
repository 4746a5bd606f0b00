"""``hangs`` with ``recover`` on one real 4-rank torchrun run of Megatron's ``pretrain()`` (CPU, gloo, DP=4),
launched as ``ft-plugins run -- torchrun --standalone --max-restarts 1 ...``, against the uninterrupted run.

Two faults, each hang deaf to SIGTERM. After 2 completed steps rank 1 gets stuck inside its optimizer update (the
others had finished theirs: they wait for it in the next step's gradient all-reduce); the launcher finds it within
the step bound, logs its stacks, ends it, and ``recover`` replaces it in place. After 4 completed steps rank 2 gets
stuck as its data loader hands out the step's first batch while rank 3 is killed in the same step: a hang and a
death at once. ``recover`` starts replacing the dead rank 3; the repair waits for rank 2, which the launcher finds
hung (its section's bound: the step's, not raised by the steps the faults cut short) and ends; a second rank lost
during a repair is not repaired in place, so the survivors dump step 4 (one writer, though they stand in different
group generations) and torchrun restarts the job, which resumes from the dump. The job ends by itself, exit 0, every
step kept, its final save bit for bit the uninterrupted run's.
"""

from __future__ import annotations

import pytest

from report_check import check_faults, report
from step_bounds import step_bound
from ttp_runs import DP4, ITERS, Job, run_supervised, same_as_reference

UPDATE, DATA = 2, 4  # completed steps before the hang in the update; before the hang in the data loader + the death
BOUNDS = {"FT_PLUGINS_HANGS_FLOOR": "3", "FT_PLUGINS_HANGS_WARMUP": "120", "FT_PLUGINS_HANGS_WARMUP_STEPS": "1",
          "FT_PLUGINS_HANGS_DATA": "3", "FT_PLUGINS_HANGS_GRACE": "1"}
FAULTS = (f"rank=1,step={UPDATE},kind=stuck,at=update;rank=2,step={DATA},kind=stuck,at=data;"
          f"rank=3,step={DATA},kind=kill")
STACK = "ft_plugins/faults.py"  # where the drill's stuck rank stands


@pytest.fixture(scope="module")
def reference(dp4_reference: Job) -> Job:
    """Uninterrupted, without ft_plugins, saving every step (shared with the other 4-rank modules)."""
    return dp4_reference


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("hang_dp4")
    return run_supervised(workdir, DP4, "--save-interval", "100", "--load", str(workdir / "ckpt"),
                          launcher=("--standalone", "--max-restarts", "1"), FT_PLUGINS="ttp,recover,resume,hangs",
                          **BOUNDS, FT_PLUGINS_INJECT_FAULT=FAULTS)


def _stacks(job: Job, rank: int) -> str:
    """What the launcher logged of ``rank``'s hang: its line and its stacks."""
    return job.output.split(f"hangs: rank {rank} (pid", 1)[1].split("wait for it in a collective", 1)[0]


def test_a_hang_in_the_optimizer_update_is_met_in_place(hung: Job) -> None:
    assert hung.returncode == 0, hung.output[-5000:]
    assert f"in step of step {UPDATE + 1} (bound " in _stacks(hung, 1)
    step_bound(hung, _stacks(hung, 1))  # the rule's, for the steps this machine ran
    assert STACK in _stacks(hung, 1) and "step_with_ready_grads" in _stacks(hung, 1)
    assert hung.lines("hangs: ranks 0, 2, 3 wait for it in a collective")
    assert hung.lines("recover: rank 1 exited with code -9; replacement pid")
    # the others had finished step 3: they count it as done, the replacement starts from their state of it
    assert hung.lines(f"every rank stands at step {UPDATE + 1}, training continues at step {UPDATE + 2}")


def test_a_hang_in_the_data_loader_while_another_rank_dies_ends_in_a_dump_and_a_restart(hung: Job) -> None:
    assert hung.lines("recover: rank 3 exited with code -9; replacement pid")
    stacks = _stacks(hung, 2)
    assert f"in data of step {DATA + 1} (bound " in stacks
    step_bound(hung, stacks)  # the step bound, not one a fault's wait taught (a wait of the bound, 5 x over)
    assert STACK in stacks and "ft_plugins/torch/megatron/drill.py" in stacks and "in __next__" in stacks
    assert hung.lines("recover: rank 2 exited with code -9 and is not replaced: a second fault during recovery")
    # one writer: a survivor of generation 1 (holding) and its replacement of rank 1 (joined to it) had both written
    assert len(hung.lines(f"dumped mp_rank_00 of iteration {DATA} in")) == 1 and not hung.lines("dump failed")
    assert hung.lines(f"loading checkpoint from {hung.save} at iteration {DATA}")


def test_four_ranks_two_hangs_and_a_death_end_bit_identical(hung: Job, reference: Job) -> None:
    assert hung.returncode == 0 and hung.tracker() == str(ITERS), hung.output[-5000:]
    assert len(hung.lines("firing injected fault")) == 3 and len(hung.lines("made no progress")) == 2
    assert same_as_reference(hung, reference, DATA) == []  # the dump: model, optimizer, RNG
    assert same_as_reference(hung, reference, ITERS, rng=False) == []  # after a resume: see differences()


def test_the_report_names_both_hangs_and_how_each_was_met(hung: Job) -> None:
    """Rank 2's hang and rank 3's death in one step are one interruption, met by the dump and the restart; the
    report names it after whichever of the two was recorded first (they fire in the same step)."""
    second = {2: (2, "hang", "hang kill, dump + restart", DATA), 3: (3, "death", "dump + restart", DATA)}
    named = [fault["rank"] for fault in report(hung)["faults"]][1:2]
    assert named and named[0] in second, report(hung)
    check_faults(hung, [(1, "hang", "hang kill, in place", UPDATE), second[named[0]]])
