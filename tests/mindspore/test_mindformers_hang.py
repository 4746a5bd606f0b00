"""A hang on MindFormers' own launch path: ``fixtures/run_mindformer.py`` under msrun, 2 CPU workers, data parallel
(``mindformers_runs``: 4 steps an epoch, 3 epochs, a save every 2 steps), the YAML's ``FaultTolerance`` entry, no
import in the script. Rank 1 stops for good once step 7 ended, in MindFormers' loss monitor, deaf to SIGTERM.

Under ``ft-plugins run -- msrun`` with ``FT_PLUGINS=ttp,resume,hangs``, msrun's watch finds it, logs its stacks
and ends it; step 7 is dumped for both ranks (a step after the last save), by rank 0, or by rank 1's own stall
rule when that comes first; the relaunch, resuming as MindFormers
documents (``resume_training``), trains steps 8 to 12 as the uninterrupted run did, bit for bit. Beside it, at
the same time, the same hang with MindFormers alone: still waiting past the bound (the negative control).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

import msrun_jobs
from mindformers_runs import ENTRY, losses, task_yaml, tokens
from msrun_jobs import WORKERS, Control, Job, assert_same_parameters, job_env

STEPS_PER_EPOCH, EPOCHS = 4, 3  # 16 samples, 2 a batch, 2 workers
STUCK_AFTER = 7  # a step after the save of step 6
FT_RUN = msrun_jobs.ft_run(20)
# a MindFormers step takes 0.5 to 1.5 s here, several times that on a loaded machine: a floor of 3 s (the plain
# MindSpore job's) was crossed by a slow step 3 under load, and every rank was taken for stalled; a floor of 15 s per
# MindFormers step, and 2 x the slowest step, not 5 x: under CI's load a step took 4.9 s and 5 x made the bound 24.3 s,
# past the control's look (the look cannot wait longer, see HELD)
HANG_BOUNDS = {"FT_PLUGINS_HANGS_FLOOR": "15", "FT_PLUGINS_HANGS_FACTOR": "2", "FT_PLUGINS_HANGS_WARMUP": "120",
               "FT_PLUGINS_HANGS_GRACE": "1"}
# seconds the hang without ft_plugins is watched after its step 7: past the bound the watch gives the step (15 s
# unless 2 slow steps make it longer), short of MindSpore's own CPU collective, which gives up on the wait after
# about 30 s (HCCL after 1836 s); looked at after 35 s, rank 0 had just failed in its AllReduce
HELD = 24
FAULT_TOLERANCE = """
  - type: FaultTolerance"""


def _start(workdir: Path, data: Path, resume: bool = False, launcher: tuple[str, ...] = (), **env: str) -> Job:
    """run_mindformer.py under msrun in ``workdir`` (MindFormers writes ./output there), not waited for;
    ``FaultTolerance`` in the YAML when ``env`` names features."""
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    config = workdir / "task.yaml"
    config.write_text(task_yaml(data, EPOCHS, resume, FAULT_TOLERANCE if "FT_PLUGINS" in env else "", WORKERS))
    return msrun_jobs.start(workdir, "", job_env(FT_TEST_OUT=str(workdir / "out"), **env),
                            root=workdir / "output" / "checkpoint", launcher=launcher,
                            program=(str(ENTRY), str(config)))


def _losses(job: Job, rank: int) -> dict[int, str]:
    """The losses ``rank`` logged so far (none before msrun opened its log)."""
    return losses(job.log(rank), STEPS_PER_EPOCH) if (job.logs / f"worker_{rank}.log").exists() else {}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokens(tmp_path_factory.mktemp("tokens"), 16)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Job:
    """The job uninterrupted, MindFormers alone."""
    job = msrun_jobs.wait(_start(tmp_path_factory.mktemp("reference"), data))
    assert job.returncode == 0, job.stdout[-4000:]
    return job


def _reached_the_hang(job: Job) -> float:
    """Once rank 1 logged step 7: its time."""
    deadline = time.monotonic() + 240
    while STUCK_AFTER not in _losses(job, 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    return time.time()


def _steps(job: Job, rank: int) -> list[int]:
    return sorted(_losses(job, rank))


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory, data: Path) -> tuple[Job, Control]:
    """Rank 1 stuck for good once step 7 ended, under ``ft-plugins run -- msrun``; beside it the same hang with
    MindFormers alone."""
    stuck = f"1,{STUCK_AFTER}"
    control = Control(_start(tmp_path_factory.mktemp("hang_alone"), data, FT_TEST_STUCK=stuck), _reached_the_hang,
                      _steps, HELD)
    job = msrun_jobs.wait(_start(tmp_path_factory.mktemp("hung"), data, launcher=FT_RUN, FT_TEST_STUCK=stuck,
                                 FT_PLUGINS="ttp,resume,hangs", **HANG_BOUNDS), faulted=True)
    control.thread.join(300)
    return job, control


@pytest.fixture(scope="module")
def resumed(hung: tuple[Job, Control], data: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The hung job relaunched on a copy of its ``output`` as MindFormers documents a resume, under ``ft-plugins
    run``."""
    workdir = tmp_path_factory.mktemp("resumed")
    shutil.copytree(hung[0].root.parent, workdir / "output")
    for path in (workdir / "output").rglob("*"):
        path.chmod(0o644 if path.is_file() else 0o755)  # MindSpore writes checkpoints read-only
    job = msrun_jobs.wait(_start(workdir, data, resume=True, launcher=FT_RUN, FT_PLUGINS="ttp,resume,hangs",
                                 **HANG_BOUNDS))
    assert job.returncode == 0, job.stdout[-4000:]
    return job


def test_a_hung_mindformers_rank_is_found_named_with_its_stacks_and_ended(hung: tuple[Job, Control]) -> None:
    job = hung[0]
    assert "hangs watched by msrun: a step max(15 s, 2 x the slowest step)" in job.stdout, job.stdout[-3000:]
    found, stacks = msrun_jobs.hang_found(job, 1)
    assert f"of step {STUCK_AFTER} (bound " in found, found
    assert re.search(r'run_mindformer\.py", line \d+ in stuck', stacks), stacks[:3000]  # where it stands
    assert "mindformers/trainer/base_trainer.py" in stacks and "in training_process" in stacks
    assert "hangs: rank 0 waits for it in a collective" in job.stdout
    pid = int(found.split("(pid ", 1)[1].split(")", 1)[0])  # SIGKILLed (it ignored SIGTERM): a death to msrun
    assert f"Worker process {pid} exit with exception. Error code: -9." in job.stdout
    assert [max(_losses(job, rank)) for rank in range(WORKERS)] == [STUCK_AFTER, STUCK_AFTER]
    assert "run's torchrun" not in job.log(0)  # MindFormers imports torch: no torch glue in an msrun worker


def test_the_hang_s_dump_holds_step_7_for_both_ranks(hung: tuple[Job, Control]) -> None:
    from ft_plugins.checkpoint import find_latest
    from ft_plugins.checkpoint.layouts.mindspore import recorded_step

    job = hung[0]
    # rank 0 on the stall or on rank 1's death; or rank 1 itself, whose watcher goes on while its main thread
    # hangs: its stall rule may come before the watch ends it (each file has one writer; the other says so)
    said = " ".join(line for rank in range(WORKERS) for line in job.log(rank).splitlines()
                    if f"dying-gasp checkpoint of step {STUCK_AFTER} written" in line)
    assert said, (job.log(0)[-3000:], job.log(1)[-3000:])
    for rank in range(WORKERS):
        latest = find_latest(job.root, rank=rank)
        assert recorded_step(latest.path) == STUCK_AFTER and latest.path in said, (rank, latest, said)


def test_the_relaunch_resumes_at_step_8_bit_identical(hung: tuple[Job, Control], resumed: Job,
                                                     reference: Job) -> None:
    from mindspore import load_checkpoint

    from ft_plugins.checkpoint.layouts.mindspore import recorded_step

    assert re.search(rf"MindFormers resumes from \S+ \(step {STUCK_AFTER}\)", resumed.log(0)), resumed.log(0)[-3000:]
    for rank in range(WORKERS):
        expected = _losses(reference, rank)
        assert sorted(expected) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
        assert _losses(resumed, rank) == {step: expected[step] for step in range(STUCK_AFTER + 1, len(expected) + 1)}
        last = {}
        for job in (reference, resumed):
            saves = {recorded_step(str(path)): path for path in (job.root / f"rank_{rank}").glob("*.ckpt")}
            last[job is resumed] = load_checkpoint(str(saves[len(expected)]))
        assert_same_parameters(*({name: value.asnumpy() for name, value in state.items()}
                                 for state in last.values()))  # weights, moments, step and epoch counts


def test_without_ft_plugins_the_same_hang_is_still_waiting_past_the_bound(hung: tuple[Job, Control]) -> None:
    job, control = hung
    bound = float(re.search(r"\(bound ([0-9.]+) s\)", msrun_jobs.hang_found(job, 1)[0]).group(1))
    assert HELD > bound, (HELD, bound)  # the control was looked at once ft_plugins had acted
    assert len(control.alive) == WORKERS and all(control.alive.values()), control.alive
    assert control.steps == [list(range(1, STUCK_AFTER + 1))] * WORKERS  # no step after 7, nothing said
    assert control.lines == []
