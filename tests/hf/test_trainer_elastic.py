"""``elastic`` for the Trainer, by restart: real torchrun agents as two nodes of 2 ranks (``--nnodes 1:2``, c10d), the
second node lost for good in step 4; ``ttp`` dumps step 3, torchrun starts the job again on the node left, and the
Trainer resumes the dump with 2 processes instead of 4.

- With ``elastic``, the gradient accumulation goes from 1 to 2: the global batch of 8 is kept, every step reads
  exactly the samples the uninterrupted 4-process run reads in it, and the end is bit for bit (model and optimizer)
  the Trainer's own resume of the same dump by 2 processes with the accumulation set to 2 by hand.
- Grown back: the 2-process job's save of step 6 (accumulation 2) resumed by 4 processes with the script's
  accumulation of 1 is the same global batch: steps 7 to 10 read the uninterrupted run's samples; ranks 2 and 3,
  which have no RNG file, load rank 0's.
- Negative control, the same loss without ``elastic``: the global batch halves and the Trainer's skip, counted in
  steps, lands on samples the job trained on already (one line says so)."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from agents import run_agents
from hf_runs import EXAMPLE, run_trainer, same_state

SAMPLED = Path(__file__).resolve().parent / "fixtures" / "sampled_train.py"
# the first rendezvous waits up to 15 s for the second node (a round closed on one would be restarted when it comes)
LOSS = {"FT_PLUGINS_INJECT_FAULT": "rank=2,step=3,kind=stuck"}  # rank 2's node lost in step 4, 3 steps done
STEPS, SAVE = "8", "6"
ELASTIC = {"FT_PLUGINS": "resume,ttp,elastic"}


def _samples(log: Path) -> dict[int, dict[int, list[int]]]:
    """Each process (pid) of the job: each step's samples, in the order read."""
    read: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for path in log.glob("samples_*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            read[record["pid"]][record["step"]].append(record["index"])
    return read


def _completed(log: Path) -> dict[int, list[int]]:
    """Each step's samples, sorted, as the processes that completed it read them: the step a process of an earlier
    start was in when the job stopped (the one the loss interrupted) is left to the processes after it."""
    by_pid = _samples(log)
    end = max(max(read) for read in by_pid.values())
    steps: dict[int, list[int]] = defaultdict(list)
    for read in by_pid.values():
        done = max(read) if max(read) == end else max(read) - 1
        for step in [step for step in read if step <= done]:
            steps[step] += read[step]
    return {step: sorted(indices) for step, indices in steps.items()}


def _shrink(workdir: Path, env: dict[str, str]) -> tuple[Path, str, Path]:
    """The two-node job losing its second node: its save folder, its output and its sample log."""
    out, log = workdir / "out", workdir / "samples"
    log.mkdir()
    agents = run_agents(workdir, (str(SAMPLED), str(out), "--steps", STEPS, "--save-steps", SAVE, "--final",
                                  str(workdir / "final.pt")),
                        lose=(2,), restarts=1, last_call=15, timeout=360, FT_TEST_SAMPLE_LOG=str(log), **LOSS, **env)
    assert agents.codes[0] == 0, agents.outputs[0][-6000:]
    return out, agents.output, log


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    """The samples of each step of the 4-process run, 10 steps."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    (workdir / "samples").mkdir()
    job = run_trainer(workdir, workdir / "out", "--steps", "10", "--save-steps", "100", script=SAMPLED, ranks=4,
                      FT_TEST_SAMPLE_LOG=str(workdir / "samples"), OMP_NUM_THREADS="1")  # stock aborts at gloo's exit
    assert job.returncode == 0, job.output[-4000:]
    return _completed(workdir / "samples")


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    return _shrink(tmp_path_factory.mktemp("shrunk"), ELASTIC)


def test_the_dump_resumed_by_half_the_processes_keeps_the_global_batch(
        shrunk: tuple[Path, str, Path], uninterrupted: dict[int, list[int]]) -> None:
    out, output, log = shrunk
    dumped = [line for line in output.splitlines() if "dumped" in line]
    assert len(dumped) == 1 and "checkpoint-3 in" in dumped[0], output[-6000:]
    kept = [line for line in output.splitlines() if "gradient accumulation 2 (was 1)" in line]
    assert len(kept) == 1 and "written by 4 processes, 2 resume it" in kept[0], output[-6000:]
    assert "global batch of 8 samples" in kept[0] and "24 samples read" in kept[0]
    steps = _completed(log)
    assert sorted(steps) == list(range(1, int(STEPS) + 1))
    assert {step: steps[step] for step in steps} == {step: uninterrupted[step] for step in steps}
    assert sorted(index for step in range(1, 9) for index in steps[step]) == list(range(64))  # one epoch, each once


def test_the_end_is_the_trainers_own_resume_with_the_accumulation_set_by_hand(
        shrunk: tuple[Path, str, Path], tmp_path: Path) -> None:
    out, _, _ = shrunk
    by_hand = tmp_path / "out"
    by_hand.mkdir()
    shutil.copytree(out / "checkpoint-3", by_hand / "checkpoint-3")
    # ttp alone: the Trainer's own resume, and the drained exit (stock sometimes aborts at gloo's exit: clean_exit.py)
    job = run_trainer(tmp_path, by_hand, "--steps", STEPS, "--save-steps", SAVE, "--gradient-accumulation-steps", "2",
                      script=EXAMPLE, FT_PLUGINS="ttp", OMP_NUM_THREADS="1")
    assert job.returncode == 0, job.output[-4000:]
    assert same_state(job.final, out.parent / "final.pt") == []


def test_grown_back_the_save_of_two_processes_resumed_by_four_reads_on(
        shrunk: tuple[Path, str, Path], uninterrupted: dict[int, list[int]], tmp_path: Path) -> None:
    out, _, _ = shrunk
    grown, log = tmp_path / "out", tmp_path / "samples"
    grown.mkdir()
    log.mkdir()
    shutil.copytree(out / f"checkpoint-{SAVE}", grown / f"checkpoint-{SAVE}")
    job = run_trainer(tmp_path, grown, "--steps", "10", "--save-steps", "100", script=SAMPLED, ranks=4,
                      FT_TEST_SAMPLE_LOG=str(log), OMP_NUM_THREADS="1", **ELASTIC)
    assert job.returncode == 0, job.output[-4000:]
    assert not job.lines("gradient accumulation")  # 2 per device x 4 processes x 1: the global batch of 8 already
    assert len(job.lines("no RNG file for process")) == 2 and len(job.lines("it takes rng_state_0.pth")) == 2
    steps = _completed(log)
    assert steps == {step: uninterrupted[step] for step in range(int(SAVE) + 1, 11)}


def test_without_elastic_the_trainer_trains_on_samples_again_and_says_so(
        tmp_path: Path, uninterrupted: dict[int, list[int]]) -> None:
    out, output, log = _shrink(tmp_path, {"FT_PLUGINS": "resume,ttp"})
    said = [line for line in output.splitlines() if "resume: " in line
            and "was written by 4 processes with a global batch of 8" in line]  # resume speaks: elastic is off
    assert len(said) == 1 and "samples 12 to 23 of the order are trained on again" in said[0], output[-6000:]
    steps = _completed(log)
    assert all(len(steps[step]) == 4 for step in range(4, int(STEPS) + 1))  # the global batch halved
    assert set(steps[5]) | set(steps[6]) == set(uninterrupted[3])  # step 3's samples, trained on again
