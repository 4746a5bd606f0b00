"""Real msrun jobs, 2 CPU workers, data parallel (``fixtures/msrun_train.py``: 24 steps, a save every 4),
written as the plain-MindSpore recipe of docs/frameworks/mindspore.md shows, against the same job run uninterrupted.

Nothing is faked: msrun, its scheduler, MindSpore's Model.train, ModelCheckpoint and collectives, the checkpoints
on disk. A crash is rank 1 SIGKILLing itself right after a step ended; a preemption is SIGTERM to the launcher. The
jobs form one chain, each fixture built on the one before: reference (MindSpore alone; msrun SIGTERMed, its orphans
train on to the end) · crashed (MindSpore alone, rank 1 killed after step 14) · dumped (the same with ``ttp`` under
``ft-plugins run``, each file of the dump taking 2.5 s more, as on a slow file system: msrun's kill of the survivor
is SIGTERM and the run's grace first, so the dump completes; no ``--grace``: the grace follows what rank 0 reports
a dump needs) · cut short (the same under plain msrun: its SIGKILL comes within a second, the dump never completes;
the negative control of the grace) · hung (under ``ft-plugins run`` with ``ttp,resume,hangs``, rank 1 stuck for
good after step 14, deaf to SIGTERM: msrun's watchdog ends it, rank 0 dumps step 14, bit-identical to the crash's
dump; beside it the same hang with MindSpore alone, still waiting) · preempted (relaunched on the crash's dump with
the recipe under ``ft-plugins run``, ``FaultTolerance`` listed after the slow step log, SIGTERM to it after step
19) · finished (relaunched again, to the end, with a grace of 3 s: shorter than a dump at the speed recorded).
The three launches with ft_plugins are one job by its name (``FT_PLUGINS_EVENTS_JOB``): their events, beside the
checkpoints, are copied with them from launch to launch, and ``ft-plugins report`` reads the whole chain.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import msrun_jobs
from msrun_jobs import (HANG_BOUNDS, STEPS, WORKERS, Control, Job, alive, assert_same_parameters, copy_root, job_env,
                        latest_step, processes)
from support import PYTHON, assert_agrees, wait_gone

KILLED_AFTER = 14  # two steps after the save of step 12
# the relaunch starts at step 15 and saves at 18 and 22: SIGTERM once step 19 ended, each step after 18 taking
# SLOWED s more, reaches the workers between the two, at a step no regular save writes: about 3 x SLOWED s for the
# signal's way (the launcher, msrun, the workers' process groups) on a loaded machine too; the exit after the dump
# does not wait for the slow step's sleep
STOPPED_AFTER, NEXT_SAVE = 19, 22
SLOWED = 3
GRACE = 20
FT_RUN = msrun_jobs.ft_run(GRACE)
JOB = {"FT_PLUGINS_EVENTS_JOB": "msrun-chain"}  # the launches with ft_plugins: one job, relaunched
SLOW_DUMP = 2.5  # seconds each file of the crash's dump takes more: the dump of both outlasts msrun's second
SHORT_GRACE = 3  # the last launch's: shorter than a dump at the recorded speed needs
HELD = 10  # seconds the hang without ft_plugins is watched after its step 14: over 3 x the step bound


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The job uninterrupted, MindSpore alone; its msrun is SIGTERMed after step 3 and dies at once (143),
    while its workers and scheduler, orphaned, train on to the end: that end is the reference. The steps
    after step 3 are slowed (values unchanged), so that the signal always finds msrun still running."""
    job = msrun_jobs.start(tmp_path_factory.mktemp("reference"), "plain", job_env(FT_TEST_SLOW="3"))
    msrun_jobs.wait_for_step(job, 0, 3)
    job.process.send_signal(signal.SIGTERM)
    msrun_jobs.wait(job)
    job.orphans = [pid for pid in processes(job) if alive(pid)]  # type: ignore[attr-defined]
    job.tails = msrun_jobs.log_tails(job)  # type: ignore[attr-defined]
    wait_gone(job.orphans)  # type: ignore[attr-defined]
    for pid in job.tails:  # type: ignore[attr-defined]  # `tail -f` never ends by itself
        os.kill(pid, signal.SIGKILL)
    return job


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Job:
    job = msrun_jobs.run(tmp_path_factory.mktemp("crashed"), "plain", job_env(FT_TEST_KILL=f"1,{KILLED_AFTER}"),
                         faulted=True)
    assert job.returncode != 0 and job.steps(1)[-1] == KILLED_AFTER, job.stdout[-3000:]
    return job


def _slow_dump_crash(workdir: Path, launcher: tuple[str, ...], **env: str) -> Job:
    """The crash with the documented recipe and ``FT_PLUGINS=ttp,resume`` (the built-in engine: no MindIO here),
    each file of the dump slowed."""
    job = msrun_jobs.run(workdir, "recipe", job_env(FT_PLUGINS="ttp,resume", FT_TEST_KILL=f"1,{KILLED_AFTER}",
                                                    FT_TEST_SLOW_DUMP=str(SLOW_DUMP), **env),
                         faulted=True, launcher=launcher)
    assert job.returncode != 0 and job.steps(1)[-1] == KILLED_AFTER, job.stdout[-3000:]
    return job


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Under ``ft-plugins run`` with no ``--grace``: the grace planned (msrun's 20 s) follows what the workers
    report their dump needs."""
    return _slow_dump_crash(tmp_path_factory.mktemp("dumped"), msrun_jobs.ft_run(None), **JOB)


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _slow_dump_crash(tmp_path_factory.mktemp("cut_short"), ())


def _reached_the_hang(job: Job) -> float:
    msrun_jobs.wait_for_step(job, 1, KILLED_AFTER)
    return os.stat(job.out / "steps_1.jsonl").st_mtime


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Control]:
    """Rank 1 stuck for good right after step 14 under ``ft-plugins run -- msrun`` with ``ttp,resume,hangs``;
    beside it, at the same time, the same hang with MindSpore alone (the negative control)."""
    stuck = f"1,{KILLED_AFTER}"
    control = Control(msrun_jobs.start(tmp_path_factory.mktemp("hang_alone"), "plain", job_env(FT_TEST_STUCK=stuck)),
                      _reached_the_hang, Job.steps, HELD)
    env = job_env(FT_PLUGINS="ttp,resume,hangs", FT_TEST_STUCK=stuck, **HANG_BOUNDS)
    job = msrun_jobs.wait(msrun_jobs.start(tmp_path_factory.mktemp("hung"), "recipe", env, launcher=FT_RUN),
                          faulted=True)
    control.thread.join(120)
    return job, control


@pytest.fixture(scope="module")
def preempted(dumped: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Relaunched on the crash's dump under ``ft-plugins run``; SIGTERM to the launcher once rank 0 ended step 19.
    ``FaultTolerance`` is listed last, so the signal finds each worker in the step log's slow step end, before
    FaultTolerance's own: the step it follows is completed all the same."""
    workdir = tmp_path_factory.mktemp("preempted")
    root = copy_root(dumped.root, workdir / "ckpt")
    env = job_env(FT_PLUGINS="ttp,resume", FT_TEST_SLOW=f"{STOPPED_AFTER - 1}:{SLOWED}", **JOB)
    job = msrun_jobs.start(workdir, "recipe_last", env, root=root, launcher=FT_RUN)
    msrun_jobs.wait_for_step(job, 0, STOPPED_AFTER)
    job.signalled = time.time()
    job.process.send_signal(signal.SIGTERM)
    return msrun_jobs.wait(job)


@pytest.fixture(scope="module")
def finished(preempted: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("finished")
    return msrun_jobs.run(workdir, "recipe", job_env(FT_PLUGINS="ttp,resume", **JOB),
                          root=copy_root(preempted.root, workdir / "ckpt"), launcher=msrun_jobs.ft_run(SHORT_GRACE))


@pytest.fixture(scope="module")
def own_disks(dumped: Job, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[tuple[int, int]]]:
    """The crash's checkpoints on disks each rank alone sees (``node0/rank_0``, ``node1/rank_1``, as on node-local
    disks), rank 1's dump of step 14 truncated on its disk; relaunched with the recipe and ``resume``. With it, the
    (epoch, step) each rank's disk alone would resume, read before the relaunch."""
    from ft_plugins.checkpoint import find_latest

    workdir = tmp_path_factory.mktemp("own_disks")
    shared = copy_root(dumped.root, workdir / "shared")
    nodes = [workdir / f"node{rank}" for rank in range(WORKERS)]
    for rank, node in enumerate(nodes):
        node.mkdir()
        (shared / f"rank_{rank}").rename(node / f"rank_{rank}")
    damaged = next((nodes[1] / "rank_1").glob("*-2_6.ckpt"))
    os.truncate(damaged, damaged.stat().st_size // 2)
    alone = [find_latest(node, rank=rank) for rank, node in enumerate(nodes)]
    job = msrun_jobs.run(workdir, "recipe", job_env(FT_PLUGINS="resume"), root=workdir / "node{rank}")
    return job, [(selection.epoch, selection.step) for selection in alone]


def test_without_ft_plugins_sigterm_to_msrun_orphans_the_job(reference: Job) -> None:
    """The negative control of the preemption: msrun dies at once and its scheduler and workers train on
    (and its `tail -f` of each worker's log runs on for ever)."""
    assert reference.returncode == -signal.SIGTERM
    assert len(reference.tails) == WORKERS
    assert sorted(processes(reference)[pid] for pid in reference.orphans) == ["MS_SCHED", "MS_WORKER", "MS_WORKER"]
    for rank in range(WORKERS):
        assert reference.steps(rank) == list(range(1, STEPS + 1))


def test_without_ttp_a_crash_loses_the_steps_since_the_last_save(crashed: Job) -> None:
    assert latest_step(crashed.root) == (2, 4)  # step 12: steps 13 and 14 are lost


def test_a_crash_between_saves_loses_no_step_with_ttp(dumped: Job) -> None:
    """Rank 0 writes step 14 for both ranks, committed, in over twice msrun's second: msrun's stop of the survivor
    is SIGTERM, then the grace of ``ft-plugins run``, then SIGKILL. The grace rests on what rank 0 reported after
    its saves: a dump of both ranks' files at the slowest save's speed, well inside the 20 s planned."""
    assert dumped.steps(0)[-1] == KILLED_AFTER  # rank 0 ended step 14 too, then hung in step 15's AllReduce
    stop = [line for line in dumped.stdout.splitlines() if "msrun stops the other workers" in line]
    assert len(stop) == 1 and f"SIGTERM, SIGKILL after {GRACE} s for their dying gasp (a dump needs about " in stop[0]
    assert re.search(r"measured on the save net-\d+_\d+\.ckpt(, the slowest of the \d+ writes recorded)?, for a "
                     r"dump of 2 files\)\)$", stop[0]), stop
    # rank 0's watcher sees its peer's exit, or msrun's SIGTERM comes first on a loaded machine: either way the dump
    # names the exit (the report's death), and a SIGTERM after the watcher's dump finds the step written (and names
    # the exit too)
    written = re.search(r"(SIGTERM after )?worker process \d+ of this node exited: dying-gasp checkpoint of step 14 "
                        r"written in ([0-9.]+) s", dumped.log(0))
    assert written and float(written.group(2)) >= WORKERS * SLOW_DUMP, dumped.log(0)[-3000:]
    if written.group(1) is None:
        assert re.search(r"SIGTERM after worker process \d+ of this node exited: step 14 already written",
                         dumped.log(0)), dumped.log(0)[-3000:]
    for rank in range(WORKERS):
        directory = dumped.root / f"rank_{rank}"
        assert (directory / "net-2_6.ckpt").is_file() and (directory / "ft_manifest-net-2_6.json").is_file()
        assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]  # no claim or staging left
    assert latest_step(dumped.root) == (2, 6)
    assert "dying-gasp checkpoint of step 14 written" in dumped.log(0)


def test_negative_control_under_plain_msrun_the_same_dump_is_cut_short(cut_short: Job) -> None:
    """msrun SIGKILLs the survivor within a second of the death: its dump, under way, never completes; nothing of
    it reads as a checkpoint, and resume takes the save of step 12 (steps 13 and 14 lost)."""
    assert "msrun stops the other workers" not in cut_short.stdout
    assert "dying-gasp checkpoint of step 14 written" not in cut_short.log(0)
    for rank in range(WORKERS):
        assert not (cut_short.root / f"rank_{rank}" / "net-2_6.ckpt").exists()
    left = [path.name for path in (cut_short.root / "rank_0").iterdir() if path.name.startswith(".")]
    assert ".ft_ttp_claim-net-2_6" in left, left  # the dump was under way: cleared at the next start
    assert latest_step(cut_short.root) == (2, 4)


def test_the_dump_and_the_regular_saves_record_their_writes_for_the_grace(dumped: Job, preempted: Job,
                                                                          finished: Job) -> None:
    """In the save root (``ft_write_speed.json``): the dump's write, both ranks' files by the one survivor, and
    rank 0's ModelCheckpoint saves. A dump at the recorded speed fits the 20 s grace of the relaunch, so nothing
    is said there; under the last launch's grace of 3 s, rank 0 says once that it would be cut short."""
    from ft_plugins import grace

    last = grace.recorded(str(dumped.root))[-1]
    assert last.what == "dump of step 14" and last.seconds >= WORKERS * SLOW_DUMP
    files = [dumped.root / f"rank_{rank}" / "net-2_6.ckpt" for rank in range(WORKERS)]
    assert last.written == sum(path.stat().st_size for path in files)
    for job in (dumped, preempted):
        assert "ttp: a dump needs about" not in job.log(0)
    last = grace.recorded(str(finished.root))[-1]
    saved = finished.root / "rank_0" / last.what.removeprefix("save ")
    assert last.what.startswith("save net_") and last.written == saved.stat().st_size
    said = [line for line in finished.log(0).splitlines() if "ttp: a dump needs about " in line]
    assert len(said) == 1, finished.log(0)[-3000:]
    assert "measured on the dump of step 14" in said[0], said
    assert f"longer than ft-plugins run's grace of {SHORT_GRACE} s before SIGKILL: " in said[0], said
    assert said[0].endswith("raise it with --grace"), said
    assert "ttp: a dump needs about" not in finished.log(1)


def test_a_hung_rank_is_found_by_msrun_s_watchdog_named_with_its_stacks_and_ended(hung: tuple[Job, Control]) -> None:
    job = hung[0]
    assert "hangs watched by msrun: a step max(3 s, 5 x the slowest step)" in job.stdout, job.stdout[-3000:]
    found, stacks = msrun_jobs.hang_found(job, 1)
    bound = re.search(rf"in between steps of step {KILLED_AFTER} \(bound ([0-9.]+) s\)", found)
    assert bound, found
    msrun_jobs.assert_step_bound(job, float(bound.group(1)))  # the rule's, for the steps this machine ran
    assert "msrun_train.py\", line" in stacks and "in on_train_step_end" in stacks  # where it stands
    assert "hangs: rank 0 waits for it in a collective" in job.stdout
    # then msrun meets its death as any other: SIGKILLed (it ignored SIGTERM), msrun stops the job
    pid = int(found.split("(pid ", 1)[1].split(")", 1)[0])
    assert f"Worker process {pid} exit with exception. Error code: -9." in job.stdout
    assert [job.steps(rank)[-1] for rank in range(WORKERS)] == [KILLED_AFTER, KILLED_AFTER]


def test_the_hang_s_dump_holds_the_crash_s_step_bit_for_bit(hung: tuple[Job, Control], dumped: Job) -> None:
    from mindspore import load_checkpoint

    job = hung[0]
    assert latest_step(job.root) == (2, 6)  # step 14, committed: the relaunch below resumes from it
    assert "dying-gasp checkpoint of step 14 written" in job.log(0)
    for rank in range(WORKERS):
        ours, theirs = (load_checkpoint(str(root / f"rank_{rank}" / "net-2_6.ckpt"))
                        for root in (job.root, dumped.root))
        assert_same_parameters({k: v.asnumpy() for k, v in ours.items()}, {k: v.asnumpy() for k, v in theirs.items()})


def test_without_ft_plugins_the_same_hang_is_still_waiting_past_the_bound(hung: tuple[Job, Control]) -> None:
    control = hung[1]
    assert len(control.alive) == WORKERS and all(control.alive.values()), control.alive
    assert control.steps == [list(range(1, KILLED_AFTER + 1))] * WORKERS  # no step after 14, nothing said
    assert control.lines == []


def test_the_relaunch_resumes_at_the_dumped_step(dumped: Job, preempted: Job, reference: Job) -> None:
    for rank in range(WORKERS):
        steps = preempted.steps(rank)
        assert steps[0] == KILLED_AFTER + 1  # 0 steps lost
        assert preempted.losses(rank) == {step: reference.losses(rank)[step] for step in steps}


def test_sigterm_to_the_launcher_ends_every_process_after_its_dying_gasp(preempted: Job) -> None:
    assert preempted.returncode == 128 + signal.SIGTERM, preempted.stdout[-3000:]
    ours = processes(preempted)
    assert sorted(ours.values()) == ["MS_SCHED", "MS_WORKER", "MS_WORKER"]
    assert not [pid for pid in ours if alive(pid)] and not msrun_jobs.log_tails(preempted)  # nothing outlives it
    last = max(preempted.steps(rank)[-1] for rank in range(WORKERS))
    assert STOPPED_AFTER <= last < NEXT_SAVE, f"SIGTERM reached the workers after the regular save of step {last}"
    epoch, step_in_epoch = (last - 1) // 8 + 1, (last - 1) % 8 + 1
    # the last completed step, committed, although the signal came before FaultTolerance's own step end
    assert latest_step(preempted.root) == (epoch, step_in_epoch)
    # both workers wrote on SIGTERM at once: every file of that step has one writer (a claim each), none left over
    marker = f"SIGTERM: dying-gasp checkpoint of step {last} written in "
    written = [path for rank in range(WORKERS) for line in preempted.log(rank).splitlines() if marker in line
               for path in line.rsplit(" s: ", 1)[-1].split(", ")]
    assert sorted(Path(path).parent.name for path in written) == ["rank_0", "rank_1"]
    for rank in range(WORKERS):
        assert not [p.name for p in (preempted.root / f"rank_{rank}").iterdir() if p.name.startswith(".")]


def test_the_second_relaunch_ends_bit_identical_to_the_uninterrupted_job(preempted: Job, finished: Job,
                                                                         reference: Job) -> None:
    from mindspore import load_checkpoint

    assert finished.returncode == 0, finished.stdout[-3000:]
    last = max(preempted.steps(rank)[-1] for rank in range(WORKERS))
    for rank in range(WORKERS):
        assert finished.steps(rank) == list(range(last + 1, STEPS + 1))
        assert finished.losses(rank) == {step: reference.losses(rank)[step] for step in range(last + 1, STEPS + 1)}
        assert_same_parameters(finished.final(rank), reference.final(rank))
    # ModelCheckpoint's cadence went on from the resumed step: the step-24 save is the uninterrupted job's
    ours = sorted((finished.root / "rank_0").glob("net_*-3_8.ckpt"))[-1]
    theirs = load_checkpoint(str(reference.root / "rank_0" / "net-3_8.ckpt"))
    assert_same_parameters({k: v.asnumpy() for k, v in load_checkpoint(str(ours)).items()},
                           {k: v.asnumpy() for k, v in theirs.items()})


def test_the_report_of_the_chain_names_each_fault_and_its_time_to_training_again(dumped: Job, preempted: Job,
                                                                                finished: Job) -> None:
    """``ft-plugins report`` on the last launch's checkpoint root: rank 1's death, seen by rank 0 (its process
    exited), met by rank 0's dump and the relaunch; the SIGTERM, met by the dumps and the next relaunch; no step
    lost. Each fault's time to training again agrees with the one measured from outside: from rank 1's SIGKILL (the
    test's SIGTERM to the launcher) to the relaunch's last worker beginning its first step, in the job's step log."""
    found = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "report", str(finished.root), "--json"],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    report = json.loads(found.stdout)
    assert [(fault["kind"], fault["how"], fault["steps_lost"]) for fault in report["faults"]] == [
        ("death", "dump + restart", 0), ("signal", "dump + restart", 0)], report
    assert report["faults"][0]["rank"] == 1
    assert all(fault["phases"]["dump"] > 0 for fault in report["faults"]), report
    training_again = [max(min(job.began(rank).values()) for rank in range(WORKERS)) for job in (preempted, finished)]
    for fault, again, at in zip(report["faults"], training_again, (dumped.killed(1), preempted.signalled)):
        assert_agrees(fault["to_training"], again - at, fault)
    assert 0 < report["goodput_percent"] < 100
    # every worker recorded its resume choice: nothing at first, then the dump of step 14, then the SIGTERM's
    last = max(preempted.steps(rank)[-1] for rank in range(WORKERS))
    choices = [json.loads(line)["chosen"] for path in (finished.root / "ft_events").iterdir()
               for line in path.read_text().splitlines() if '"ev": "resume"' in line]
    assert sorted(choice.rsplit("-", 1)[1] if choice else "" for choice in choices) == sorted(
        [""] * WORKERS + ["2_6.ckpt"] * WORKERS + [f"{(last - 1) // 8 + 1}_{(last - 1) % 8 + 1}.ckpt"] * WORKERS)


def test_without_a_resume_dir_initial_epoch_refuses_naming_it(crashed: Job,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """``FaultTolerance()`` + ``initial_epoch(...)``: before, every epoch was trained again on the loaded step 12."""
    workdir = tmp_path_factory.mktemp("no_directory")
    job = msrun_jobs.run(workdir, "no_directory", job_env(FT_PLUGINS="resume"),
                         root=copy_root(crashed.root, workdir / "ckpt"), faulted=True)
    assert job.returncode != 0
    errors = [job.error(rank) for rank in range(WORKERS) if job.error(rank)]
    assert errors  # the first rank to fail ends the job: msrun kills the other wherever it stands
    for error in errors:
        assert error.startswith("ValueError: resume: initial_epoch() cannot know where the checkpoints are")
        assert "FaultTolerance(resume_dir=DIR)" in error
    assert [job.steps(rank) for rank in range(WORKERS)] == [[], []]  # nothing trained
    assert not os.path.exists(job.out / "final_0.npz")


def test_ranks_on_disks_of_their_own_resume_the_same_step_each_reading_its_own_files(
        own_disks: tuple[Job, list[tuple[int, int]]], reference: Job) -> None:
    """Alone, rank 0 would resume the dump of step 14 and rank 1 the save of step 12 (the negative control: the
    replicas would part); agreeing (one all-gather a round), both resume step 12 and end bit-identical to the
    uninterrupted job."""
    job, alone = own_disks
    assert alone == [(2, 6), (2, 4)]
    assert job.returncode == 0, job.stdout[-3000:]
    for rank in range(WORKERS):
        assert job.steps(rank) == list(range(13, STEPS + 1))
        assert job.losses(rank) == {step: reference.losses(rank)[step] for step in range(13, STEPS + 1)}
        assert_same_parameters(job.final(rank), reference.final(rank))
    assert "intact here, but not on every rank" in job.log(0)
    assert "rank_1" in job.log(1) and "skipped" in job.log(1)
