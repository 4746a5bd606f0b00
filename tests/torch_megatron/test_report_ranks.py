"""``ft-plugins report`` names the rank that failed, not the one that noticed it first, nor the lowest: a 2-rank
``ft-plugins run -- torchrun --max-restarts`` job of Megatron's ``pretrain()``, five faults on ranks 1, 0, 1, 0, 1,
each on the next restart attempt, each met by the dump and torchrun's restart.

The signals come from outside, as the OOM killer's or an operator's do: a ``slow`` fault (a pause the report does not
count as a fault) holds the rank in its step, and the test signals it there. A SIGKILLed worker writes nothing; its
peer, stopped by torchrun, gasps and dumps; only torchrun's agent saw which worker exited first, and how."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from report_check import check_faults, report
from ttp_runs import Job, Launch, run_supervised

FAULTS = ((1, "kill"), (0, "kill"), (1, "term"), (0, "term"), (1, "kill"))  # (rank, how) on attempts 0, 1, ...
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
KINDS = {"kill": "death", "term": "signal"}  # what the report calls each
RESTARTS = ("--standalone", "--max-restarts", "6")
LENGTH = ("--train-iters", str(2 * len(FAULTS) + 2))  # every attempt trains two steps: the log's step time
PAUSE = 120  # seconds a rank waits for its signal: a signal never sent leaves the fault out of the job
LOOK_EVERY = 0.05  # seconds between looks at the workers' events


def completed(index: int) -> int:
    """Fault ``index`` fires on attempt ``index`` after this many completed steps: two more than the dump the attempt
    resumed from."""
    return 2 * index + 2


def signal_paused_ranks(folder: Path, done: threading.Event, sent: list[tuple[int, int]]) -> None:
    """Each worker whose events show its drill's pause (a ``fault`` line) gets the signal planned for its rank and
    attempt; (rank, attempt) of each, in order, into ``sent``."""
    planned = {(rank, attempt): how for attempt, (rank, how) in enumerate(FAULTS)}
    while not done.wait(LOOK_EVERY):
        for path in sorted(folder.glob("*-worker.jsonl")):
            lines = [json.loads(line) for line in path.read_text().split("\n")[:-1]]  # whole lines only
            place = (lines[0]["rank"], lines[0]["attempt"]) if lines else None
            if place in planned and place not in sent and any(line["ev"] == "fault" for line in lines):
                os.kill(lines[0]["pid"], SIGNALS[planned[place]])
                sent.append(place)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[tuple[int, int]]]:
    workdir = tmp_path_factory.mktemp("report_ranks")
    save = workdir / "ckpt"
    pauses = ";".join(f"rank={rank},step={completed(index)},kind=slow,attempt={index},seconds={PAUSE}"
                      for index, (rank, _) in enumerate(FAULTS))
    done, sent = threading.Event(), []
    shooter = threading.Thread(target=signal_paused_ranks, args=(save / "ft_events", done, sent), daemon=True)
    shooter.start()
    try:
        job = run_supervised(workdir, Launch(2), "--save-interval", "100", "--load", str(save), launcher=RESTARTS,
                             length=LENGTH, FT_PLUGINS="ttp,resume", FT_PLUGINS_INJECT_FAULT=pauses)
    finally:
        done.set()
        shooter.join()
    return job, sent


def test_each_fault_is_sent_and_met_by_dump_and_restart(restarted: tuple[Job, list[tuple[int, int]]]) -> None:
    job, sent = restarted
    assert job.returncode == 0, job.output[-6000:]
    assert sent == [(rank, attempt) for attempt, (rank, _) in enumerate(FAULTS)]
    assert job.tracker() == LENGTH[1]


def test_the_report_names_each_failed_rank_in_order(restarted: tuple[Job, list[tuple[int, int]]]) -> None:
    assert [fault["rank"] for fault in report(restarted[0])["faults"]] == [rank for rank, _ in FAULTS]


def test_the_report_gives_each_fault_its_kind_how_met_and_time_to_training(
        restarted: tuple[Job, list[tuple[int, int]]]) -> None:
    check_faults(restarted[0], [(rank, KINDS[how], "dump + restart", completed(index))
                                for index, (rank, how) in enumerate(FAULTS)])
