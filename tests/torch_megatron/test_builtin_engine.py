"""The built-in dying-gasp engine on real torchrun gloo runs of Megatron's ``pretrain()`` (DP=2,
``--ckpt-format torch``, non-distributed optimizer): every fault below is injected with
``FT_PLUGINS_INJECT_FAULT`` inside the workers, and every dump is compared bit for bit with the
uninterrupted reference run's save of the same step. Periodic saves are far away (``--save-interval
100``) unless a scenario needs them, so anything not lost is the dump's doing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Iterator

import pytest

from support import wait_gone
from ttp_runs import (ITERS, Job, children_started, committed_dump, end_children, probing_children,
                      resumed_to_the_end, run_job, same_as_reference, slow_disk)

from ft_plugins import grace
from ft_plugins.processes import alive

FAR = ("--save-interval", "100")
TTP = {"FT_PLUGINS": "ttp,resume"}
STEP = 3  # faults fire in the step that starts after 3 completed steps: a dump that loses nothing holds 3


def _fault(*faults: str) -> dict[str, str]:
    return {**TTP, "FT_PLUGINS_INJECT_FAULT": ";".join(faults)}


def _scenario(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, **env: str) -> Job:
    return run_job(tmp_path_factory.mktemp(name), *args, **env)


@pytest.fixture(scope="module")
def rank1_killed(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _scenario(tmp_path_factory, "rank1_killed", *FAR, **_fault(f"rank=1,step={STEP},kind=kill"))


@pytest.fixture(scope="module")
def resumed(rank1_killed: Job) -> Job:
    """Megatron's plain ``--load`` on the dump (a second launch, no fault)."""
    return run_job(rank1_killed.save.parent, "--load", str(rank1_killed.save), *FAR, save=rank1_killed.save, **TTP)


def test_nonzero_rank_killed_in_forward_survivor_dumps_the_last_completed_step(rank1_killed: Job,
                                                                             reference: Job) -> None:
    committed_dump(rank1_killed, STEP)
    measured = grace.measured(str(rank1_killed.save))  # the dump's write speed, for the next launch's grace
    assert measured.what == f"dump of iteration {STEP}" and measured.written > 0 and measured.seconds > 0
    assert rank1_killed.lines("firing injected fault rank=1,step=3,kind=kill,at=forward")
    assert rank1_killed.lines("rank 0 dumped mp_rank_00 of iteration 3")
    assert same_as_reference(rank1_killed, reference, STEP) == []


def test_plain_load_resumes_at_k_plus_one_and_ends_bit_identical(resumed: Job, reference: Job) -> None:
    resumed_to_the_end(resumed, reference, STEP)


def test_negative_control_without_ft_plugins_the_steps_are_lost(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = _scenario(tmp_path_factory, "control", *FAR, FT_PLUGINS="none",
                    FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")
    assert job.returncode != 0
    assert not job.save.exists() or not list(job.save.iterdir()), "nothing saved: all 3 completed steps lost"


def test_rank0_killed_rank1_dumps_through_the_launchers_store(tmp_path_factory: pytest.TempPathFactory,
                                                              reference: Job) -> None:
    job = _scenario(tmp_path_factory, "rank0_killed", *FAR, **_fault(f"rank=0,step={STEP},kind=kill"))
    committed_dump(job, STEP)
    assert job.lines("rank 1 dumped mp_rank_00 of iteration 3")
    assert same_as_reference(job, reference, STEP) == []


def test_exception_on_one_rank(tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job = _scenario(tmp_path_factory, "exception", *FAR, **_fault(f"rank=1,step={STEP},kind=exception"))
    committed_dump(job, STEP)
    assert job.lines("InjectedFault: fault injected by FT_PLUGINS_INJECT_FAULT")
    assert job.lines("InjectedFault in step 4")
    assert same_as_reference(job, reference, STEP) == []


def test_victim_killed_during_its_update_survivor_finishes_its_own_and_dumps_k_plus_one(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job = _scenario(tmp_path_factory, "kill_in_update", *FAR, **_fault(f"rank=1,step={STEP},kind=kill,at=update"))
    committed_dump(job, STEP + 1)  # every gradient was reduced before the victim died: step 4 completed on the survivor
    assert same_as_reference(job, reference, STEP + 1) == []


def test_preemption_sigterm_to_every_rank_mid_update(tmp_path_factory: pytest.TempPathFactory,
                                                     reference: Job) -> None:
    """No failed peer: both ranks get SIGTERM inside their update; the dump waits for the update to end."""
    job = _scenario(tmp_path_factory, "preempted", *FAR,
                    **_fault(f"rank=0,step={STEP},kind=term,at=update", f"rank=1,step={STEP},kind=term,at=update"))
    committed_dump(job, STEP + 1)
    assert "exitcode  : 143" in job.output or "exitcode: 143" in job.output.replace(" ", ""), job.output[-2000:]
    assert not job.lines("Connection closed by peer") and not job.lines("Connection reset by peer")
    assert same_as_reference(job, reference, STEP + 1) == []


CUT_SHORT = ("dying-gasp dump never committed: mp_rank_00: no part record (its writer was killed mid-write)")


SLOW_WRITE, GRACE = 2, 1  # seconds every checkpoint write takes more; torchrun's stop, shortened from its fixed 30 s


@pytest.fixture(scope="module")
def dump_killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """The survivor's dump SIGKILLed mid-write by torchrun when its grace ends: every checkpoint write is slowed
    (a stalled file system) and torchrun's fixed 30 s stop shortened to the suite's clock (``slow_disk``), so the
    dump, like the periodic save of step 2 before it, needs longer than torchrun gives. Also the negative control
    of ``test_dump_grace.py`` (where ``ft-plugins run`` gives the dump its time and ends what the killed rank left);
    each worker starts a child that does not watch its parent (``fixtures/child_probe``)."""
    workdir = tmp_path_factory.mktemp("dump_killed")
    children = workdir / "children.txt"
    yield run_job(workdir, "--save-interval", "2", **probing_children(children, {
        **slow_disk(SLOW_WRITE, GRACE), **_fault(f"rank=1,step={STEP},kind=kill")}))
    end_children(children)


def test_dump_killed_mid_write_is_never_committed_and_resume_says_why(dump_killed: Job) -> None:
    job = dump_killed
    assert job.tracker() == "2"
    assert (job.save / "iter_0000003_tmp" / "mp_rank_00" / ".ft_partial-0" / "model_optim_rng.pt").is_file()
    latest = subprocess.run([sys.executable, "-m", "ft_plugins.cli", "ckpt", "latest", str(job.save), "--json"],
                            capture_output=True, text=True)
    selection = json.loads(latest.stdout)
    assert selection["iteration"] == 2
    assert selection["skipped"] == [{"path": str(job.save / "iter_0000003_tmp"), "reason": CUT_SHORT}]
    measured = grace.measured(str(job.save))  # the periodic save's; the dump cut short recorded nothing
    assert measured.what == "save of iteration 2"
    assert measured.written == os.path.getsize(job.iteration(2) / "mp_rank_00" / "model_optim_rng.pt")
    assert job.lines("Unable to shutdown process"), "torchrun's SIGKILL, its grace over"
    assert not job.lines(f"dumped mp_rank_00 of iteration {STEP}")


def test_plain_torchrun_leaves_what_the_killed_rank_started_running(dump_killed: Job) -> None:
    """torch's stop signals only the workers still running: rank 1's child outlives the job (rank 0's, in the group
    torch SIGTERMed, does not)."""
    started = dict(children_started(dump_killed.save.parent / "children.txt"))
    assert sorted(started) == ["0", "1"], started
    assert alive(started["1"])
    wait_gone([started["0"]], timeout=10)


def test_plain_torchrun_rank_0_said_once_after_the_save_that_a_dump_needs_longer_than_its_grace(
        dump_killed: Job) -> None:
    warned = dump_killed.lines("ttp: a dump needs about")
    assert len(warned) == 1, dump_killed.output[-5000:]
    assert "measured on the save of iteration 2), longer than torchrun's grace of 1 s before SIGKILL" in warned[0]


def test_a_dump_killed_mid_write_beside_a_periodic_save_resumes_from_the_save(dump_killed: Job,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """What ``resume`` decides at the relaunch, asked in this process on the job's own save directory."""
    from ft_plugins.features.resume import Resume

    feature = Resume("pt", {option.name: option.default for option in Resume.options})
    feature.start()
    with caplog.at_level("WARNING", logger="ft_plugins"):
        selection = feature.choose(str(dump_killed.save))
    assert selection.iteration == 2
    said = [record.getMessage() for record in caplog.records]
    assert f"resume: skipped {dump_killed.save / 'iter_0000003_tmp'}: {CUT_SHORT}" in said, said


def test_a_dump_killed_mid_write_without_a_periodic_save_never_stops_the_relaunch(
        dump_killed: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same killed dump alone in its save directory (the periodic save and tracker left out: what a job
    without a periodic save before the fault leaves, since the dump does not depend on them): the relaunch
    starts as Megatron would without a checkpoint, in one line naming the dump it passed over and why."""
    workdir = tmp_path_factory.mktemp("dump_killed_alone")
    shutil.copytree(dump_killed.save / "iter_0000003_tmp", workdir / "ckpt" / "iter_0000003_tmp")
    # a write this slow recorded by an earlier save: plain torchrun's 30 s would cut the next dump short
    grace.record(str(workdir / "ckpt"), grace.Measured(17 * 10**9, 40.0, "save of iteration 100"))
    relaunch = run_job(workdir, "--load", str(workdir / "ckpt"), *FAR, length=("--train-iters", "1"), **TTP)
    assert relaunch.returncode == 0, relaunch.output[-3000:]
    assert relaunch.lines("holds no checkpoint, only saves that never finished (iter_0000003_tmp); starting as "
                          "the job would without one"), relaunch.output[-3000:]
    assert relaunch.lines(f"iter_0000003_tmp: {CUT_SHORT}")
    assert relaunch.lines("iteration        1/       1")
    assert not relaunch.lines("NoIntactCheckpoint")
    assert len(relaunch.lines("ttp: a dump needs about 65 s (17.00 GB by its largest writer at 425 MB/s, measured on "
                              "the save of iteration 100), longer than torchrun's grace of 30 s before SIGKILL")) == 1


def test_a_dump_killed_while_its_file_system_syncs_it_is_kept_and_the_relaunch_resumes_from_it(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    """A file system slow to put the dump on disk: its sync after the commit takes longer than torchrun's grace (the
    suite's 1 s), and torchrun's SIGKILL comes while the survivor waits for it. The dump was committed before the
    wait and what the killed process wrote stays in the page cache: the relaunch resumes at the dumped step and ends
    as the uninterrupted run. (Written, synced, then committed, as the dump was before, it was lost here; without
    ft_plugins the steps are: ``test_negative_control_without_ft_plugins_the_steps_are_lost``.)"""
    job = _scenario(tmp_path_factory, "sync_killed", *FAR, **slow_disk(0, GRACE, sync=SLOW_WRITE * 5),
                    **_fault(f"rank=1,step={STEP},kind=kill"))
    assert job.lines("Unable to shutdown process"), "torchrun's SIGKILL, its grace over"
    assert job.lines(f"rank 0 dumped mp_rank_00 of iteration {STEP} in"), job.output[-5000:]
    committed_dump(job, STEP)
    assert same_as_reference(job, reference, STEP) == []
    relaunch = run_job(job.save.parent, "--load", str(job.save), *FAR, save=job.save, **TTP)
    resumed_to_the_end(relaunch, reference, STEP)


def test_kill_during_a_periodic_save_the_dump_never_replaces_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = _scenario(tmp_path_factory, "kill_in_save", "--save-interval", "2",
                    **_fault("rank=1,step=4,kind=kill,at=save"))
    assert job.tracker() == "2"
    assert (job.save / "iter_0000004_tmp" / "mp_rank_00" / "ft_part.json").is_file()
    resumed = run_job(job.save.parent, "--load", str(job.save), "--save-interval", "2", save=job.save, **TTP)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines("dying-gasp dump never committed: iter_0000004 already exists (a periodic save of the same "
                         "step, maybe half-written): the dump is not committed over it")
    assert resumed.lines(f"loading checkpoint from {job.save} at iteration 2")


def test_two_faults_in_sequence_each_dumped_and_resumed(tmp_path_factory: pytest.TempPathFactory,
                                                        reference: Job) -> None:
    """The same command relaunched after each failure, as a scheduler would (``torchrun --max-restarts``
    restarts of this example fail to rebuild the gloo group here, with or without ft_plugins)."""
    workdir = tmp_path_factory.mktemp("two_faults")
    save = workdir / "ckpt"
    command = ("--load", str(save), *FAR)
    first = run_job(workdir, *command, save=save, **_fault("rank=1,step=2,kind=kill"))
    second = run_job(workdir, *command, save=save, **_fault("rank=0,step=4,kind=kill"))
    last = run_job(workdir, *command, save=save, **TTP)
    assert first.lines("rank 0 dumped mp_rank_00 of iteration 2") and first.returncode != 0
    assert second.lines(f"loading checkpoint from {save} at iteration 2")
    assert second.lines("rank 1 dumped mp_rank_00 of iteration 4") and second.returncode != 0
    assert last.returncode == 0, last.output[-3000:]
    assert last.lines(f"loading checkpoint from {save} at iteration 4")
    assert last.tracker() == str(ITERS)
    assert same_as_reference(first, reference, 2) == []
    assert same_as_reference(second, reference, 4, rng=False) == []  # dumped after a resume: see differences()
    assert same_as_reference(last, reference, ITERS, rng=False) == []
