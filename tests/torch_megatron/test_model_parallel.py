"""The built-in engine with tensor parallelism: 4 ranks, TP=2 x DP=2 (real torchrun ``pretrain()``, gloo).

Megatron orders ranks tensor-parallel first: shard ``mp_rank_00`` is held by ranks 0 and 2, ``mp_rank_01``
by ranks 1 and 3. One rank lost leaves a holder of each shard: the dump is committed, one writer per
shard, each shard bit for bit the uninterrupted run's save of that step. Both holders of one shard lost:
nothing to commit, and the choice falls back to the last periodic save, naming the missing shard
(``ckpt latest`` runs the same choice as the ``resume`` feature at start-up).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ttp_runs import ITERS, SHARDS, TP, Job, committed_dump, resumed_to_the_end, same_as_reference

FAR = ("--save-interval", "100")
TTP = {"FT_PLUGINS": "ttp,resume"}
STEP = 3
MISSING = "dying-gasp dump never committed: shard mp_rank_01 missing (no survivor holding it wrote it)"


@pytest.fixture(scope="module")
def reference(tp_reference: Job) -> Job:
    return tp_reference


@pytest.fixture(scope="module")
def one_lost(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return TP.run(tmp_path_factory.mktemp("tp_one_lost"), *FAR, **TTP,
                  FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


@pytest.fixture(scope="module")
def shard_lost(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Ranks 1 and 3, both holders of ``mp_rank_01``, killed in the same step; periodic saves every 2 steps."""
    return TP.run(tmp_path_factory.mktemp("tp_shard_lost"), "--save-interval", "2", **TTP,
                FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill;rank=3,step={STEP},kind=kill")


def test_one_rank_lost_each_shard_dumped_once_and_committed(one_lost: Job, reference: Job) -> None:
    committed_dump(one_lost, STEP)  # also: exactly one writer of mp_rank_00
    assert len(one_lost.lines(f"mp_rank_01 of iteration {STEP} in")) == 1, "one writer for mp_rank_01"
    assert one_lost.lines(f"rank 3 dumped mp_rank_01 of iteration {STEP}"), "rank 3 is mp_rank_01's only survivor"
    dumped = one_lost.lines(f"of iteration {STEP} in")  # one committer, the writer of the last part
    assert sorted(line.split(" ms; ")[1].split(":")[0] for line in dumped) == [
        "committed", "part 1 of 2 written; the writer of the last one commits"], dumped
    for shard in SHARDS:
        assert same_as_reference(one_lost, reference, STEP, shard=shard) == [], shard


def test_plain_load_resumes_both_shards_and_ends_bit_identical(one_lost: Job, reference: Job) -> None:
    resumed = TP.resume(one_lost, *FAR, **TTP)
    resumed_to_the_end(resumed, reference, STEP)
    assert same_as_reference(resumed, reference, ITERS, rng=False, shard="mp_rank_01") == []


def test_both_holders_of_a_shard_lost_nothing_committed_and_the_choice_says_why(shard_lost: Job) -> None:
    assert shard_lost.returncode != 0
    assert shard_lost.tracker() == "2", "the last periodic save stays the newest checkpoint"
    dump = shard_lost.save / f"iter_{STEP:07d}_tmp"
    assert (dump / "mp_rank_00" / "ft_part.json").is_file(), "the surviving shard was dumped"
    assert not (dump / "mp_rank_01").exists()
    assert not shard_lost.iteration(STEP).exists()
    latest = subprocess.run([sys.executable, "-m", "ft_plugins.cli", "ckpt", "latest", str(shard_lost.save), "--json"],
                            capture_output=True, text=True)
    selection = json.loads(latest.stdout)
    assert selection["iteration"] == 2, latest.stdout + latest.stderr
    [skipped] = selection["skipped"]
    assert skipped["path"] == str(dump)
    assert skipped["reason"] == MISSING, skipped
