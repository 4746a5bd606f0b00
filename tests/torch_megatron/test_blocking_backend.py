"""``recover`` and ``ttp``'s dump on a backend that blocks, as NCCL and HCCL do: real 4-rank torchrun runs of
Megatron's ``pretrain()`` under ``ft-plugins run``, the default group on the test backend with NCCL's semantics
(``tests/fakes/blocking_backend``: a collective whose peer is lost waits until aborted), Megatron's own gloo groups
on gloo, as on a GPU cluster.

Rank 1 killed in step 3. The survivors' collectives with it do not fail by themselves, and a copy of state to the
host waits behind them, as on a device's stream (the test backend's stand-in stream).
- ``recover``: the launcher's word of the loss (the replacement it starts) aborts their communicators, they catch the
  abort as they catch gloo's error, and the replacement joins in place: the final save is bit for bit the
  uninterrupted run's.
- ``ttp`` alone: torchrun ends the blocked survivors with SIGTERM; the dump aborts their communicators before it reads
  any state, and commits, bit for bit Megatron's save of step 2.
Negative control: the same fault with communicators that cannot be aborted (``FT_FAKE_BLOCKING_ABORT=off``): the
survivors never learn of the loss, the replacement cannot join, and the dump waits behind the blocked collective until
the grace runs out: nothing is committed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import FAKES, path_first
from ttp_runs import DP4, ITERS, Job, committed_dump, run_supervised, same_as_reference

KILLED = 2  # rank 1 killed in forward after 2 completed steps
BLOCKING = {"FT_PLUGINS": "ttp,recover", "FT_PLUGINS_INJECT_FAULT": f"rank=1,step={KILLED},kind=kill",
            "PYTHONPATH": path_first(FAKES / "blocking_backend"), "FT_FAKE_BLOCKING": "1"}
TIMEOUT = 20  # recover's bound in the negative control, where nothing comes


def _run(workdir: Path, **env: str) -> Job:
    return run_supervised(workdir, DP4, "--save-interval", "100", **{**BLOCKING, **env})


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("blocking_recovered"))


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("blocking_dumped"), FT_PLUGINS="ttp")


@pytest.fixture(scope="module")
def unaborted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("blocking_unaborted"), FT_FAKE_BLOCKING_ABORT="off",
                FT_PLUGINS_RECOVER_TIMEOUT=str(TIMEOUT))


def test_the_default_group_blocks_and_rank_0_says_what_it_does_about_it(recovered: Job) -> None:
    [note] = recovered.lines("ttp's built-in engine and recover on BLOCKING: a collective whose peer is lost blocks")
    assert "aborted when the launcher reports a lost worker or node" in note and "and before a dump" in note
    assert "not verified on BLOCKING with a lost peer" in note and "on a stream of its own" in note


def test_the_launchers_word_aborts_the_survivors_and_the_lost_rank_is_replaced_in_place(
        recovered: Job, dp4_reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert recovered.lines("rank 1 exited with code -9; replacement pid")
    for survivor in (0, 2, 3):
        assert recovered.lines(f"[ft_plugins.torch rank {survivor}] WARNING aborted this rank's"), survivor
        [caught] = recovered.lines(f"recover: rank {survivor} (pid")
        assert re.search(rf"caught DistBackendError: blocking: .* aborted in step {KILLED + 1} ", caught), caught
    assert recovered.lines(f"every rank stands at step {KILLED}, training continues at step {KILLED + 1}")
    assert not recovered.lines("loading checkpoint") and not recovered.lines("dumped")
    assert [len(recovered.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS
    assert same_as_reference(recovered, dp4_reference, ITERS) == []  # model, optimizer, scheduler, RNG, counters


def _aborted_for_the_dump(job: Job, survivor: int) -> list[str]:
    return [line for line in job.lines(f"[ft_plugins.torch rank {survivor}] WARNING aborted this rank's")
            if "(ttp's dump: SIGTERM) in " in line]


def test_the_dump_aborts_the_blocked_survivors_first_and_commits_the_last_completed_step(
        dumped: Job, dp4_reference: Job) -> None:
    assert not dumped.lines("caught"), "no survivor's collective failed by itself"
    for survivor in (0, 2, 3):
        assert _aborted_for_the_dump(dumped, survivor), survivor
    committed_dump(dumped, KILLED)  # the job ended, tracker, manifest, `ckpt verify`, one writer of the shard
    assert same_as_reference(dumped, dp4_reference, KILLED) == []  # model, optimizer, scheduler, RNG, counters


def test_without_the_abort_the_survivors_never_learn_of_the_loss_and_the_dump_never_commits(unaborted: Job) -> None:
    assert unaborted.returncode != 0
    assert not unaborted.lines("caught"), "no survivor's collective failed by itself"
    for survivor in (0, 2, 3):  # the dump tries to abort before it reads any state: nothing happens
        assert _aborted_for_the_dump(unaborted, survivor), survivor
    assert unaborted.lines(f"replacement of rank 1 cannot join: the survivors' standings did not come within {TIMEOUT}")
    assert not unaborted.lines("every rank stands at step")
    assert not unaborted.lines("dumped"), "a copy of state waits behind the blocked collective"
    assert unaborted.tracker() is None
    assert not list(unaborted.save.rglob("ft_manifest.json")), "nothing committed"
