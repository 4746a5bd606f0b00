"""A hang in a two-node msrun job: one ``ft-plugins run -- msrun --node_rank N`` per node, one CPU worker each, data
parallel (``fixtures/msrun_train.py``: 24 steps, a save every 4).

Both nodes are on this machine: node 0 is the master (its msrun starts the scheduler), node 1's msrun is told that
``--master_addr`` is not one of its addresses (``tests/fakes/other_host``, the one thing faked: a second host), so it
starts its worker only, which joins node 0's scheduler as another host's would. Each node's launcher sees only its
own worker. Rank 1 (node 1) stops for good after step 14, deaf to SIGTERM: node 1's watch ends it, saying it sees
no other node; node 0's rank 0 waits for it in a collective, writes the dump of step 14 (both ranks' files: data
parallel) and is stopped by node 0's watch. The relaunch of both nodes resumes at step 14 and ends as the same job
run uninterrupted, bit for bit; without ft_plugins the same hang still waits, and keeps no step past 12.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import msrun_jobs
from msrun_jobs import (HANG_BOUNDS, STEPS, WORKERS, Job, alive, assert_same_parameters, copy_root, job_env,
                        latest_step, processes)
from support import FAKES, free_port, kill_tree, path_first

STUCK_AFTER = 14  # two steps after the save of step 12
FT_RUN = msrun_jobs.ft_run(20)
HELD = 12  # seconds the hang without ft_plugins is looked at after its step 14: 4 x the step bound


def _nodes(workdir: Path, form: str, env: dict[str, str], launcher: tuple[str, ...] = (),
           root: Path | None = None) -> list[Job]:
    """Both nodes' launches, started at once: one checkpoint root and one output folder, a log folder each."""
    port = free_port()
    other_host = dict(env, PYTHONPATH=path_first(FAKES / "other_host"))
    return [msrun_jobs.start(workdir, form, node_env, root=root, launcher=launcher, node=(node, port))
            for node, node_env in ((0, env), (1, other_host))]


def _wait(nodes: list[Job], faulted: bool = False) -> list[Job]:
    return [msrun_jobs.wait(node, faulted=faulted) for node in nodes]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Job]:
    """The two-node job uninterrupted, MindSpore alone."""
    nodes = _wait(_nodes(tmp_path_factory.mktemp("nodes_reference"), "plain", job_env()))
    assert [node.returncode for node in nodes] == [0, 0], nodes[1].stdout[-3000:]
    return nodes


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> list[Job]:
    env = job_env(FT_PLUGINS="ttp,resume,hangs", FT_TEST_STUCK=f"1,{STUCK_AFTER}", **HANG_BOUNDS)
    return _wait(_nodes(tmp_path_factory.mktemp("nodes_hung"), "recipe", env, launcher=FT_RUN), faulted=True)


@pytest.fixture(scope="module")
def resumed(hung: list[Job], tmp_path_factory: pytest.TempPathFactory) -> list[Job]:
    workdir = tmp_path_factory.mktemp("nodes_resumed")
    root = copy_root(hung[0].root, workdir / "ckpt")
    return _wait(_nodes(workdir, "recipe", job_env(FT_PLUGINS="ttp,resume"), launcher=FT_RUN, root=root))


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The same hang with MindSpore alone, looked at ``HELD`` seconds after rank 1's step 14, then ended."""
    nodes = _nodes(tmp_path_factory.mktemp("nodes_alone"), "plain", job_env(FT_TEST_STUCK=f"1,{STUCK_AFTER}"))
    try:
        msrun_jobs.wait_for_step(nodes[0], 1, STUCK_AFTER)
        time.sleep(HELD)
        return {"alive": [alive(pid) for pid, role in processes(nodes[0]).items() if role == "MS_WORKER"],
                "steps": [nodes[0].steps(rank)[-1] for rank in range(WORKERS)],
                "latest": latest_step(nodes[0].root),
                "said": [line for node in nodes for line in msrun_jobs.launcher_output(node).splitlines()
                         if "ft_plugins" in line]}
    finally:
        for node in nodes:
            kill_tree(node.process.pid)
            node.process.wait()


def test_node_1_s_watch_ends_its_hung_rank_and_says_it_sees_no_other_node(hung: list[Job]) -> None:
    node = hung[1]
    assert "hangs watched by msrun: a step max(3 s, 5 x the slowest step)" in node.stdout, node.stdout[-3000:]
    stalled = [line for line in node.stdout.splitlines() if "hangs: every rank of this node stalled" in line]
    assert len(stalled) == 1, node.stdout[-4000:]
    assert "stopped outside collectives (ranks on other nodes are not seen from here" in stalled[0]
    stacks = node.stdout.split(stalled[0], 1)[1]
    assert "hangs: stacks of rank 1:" in stacks and "in on_train_step_end" in stacks  # where it stands
    assert [node.steps(rank)[-1] for rank in range(WORKERS)] == [STUCK_AFTER, STUCK_AFTER]


def test_node_0_s_rank_dumps_the_last_step_for_both_ranks_and_is_stopped(hung: list[Job]) -> None:
    node = hung[0]
    assert "dying-gasp checkpoint of step 14 written" in node.log(0), node.log(0)[-3000:]
    assert "rank 0 past its bound, not ended: every local rank waits in a collective: for a rank elsewhere" \
        in node.stdout, node.stdout[-4000:]
    for rank in range(WORKERS):
        directory = node.root / f"rank_{rank}"
        assert (directory / "net-2_6.ckpt").is_file() and (directory / "ft_manifest-net-2_6.json").is_file()
    assert latest_step(node.root) == (2, 6)  # step 14, committed
    assert [job.returncode for job in hung] != [0, 0]  # the job failed, for its relaunch


def test_the_relaunch_of_both_nodes_resumes_at_the_hang_and_ends_bit_identical(
        resumed: list[Job], reference: list[Job]) -> None:
    assert [node.returncode for node in resumed] == [0, 0], resumed[1].stdout[-3000:]
    for rank in range(WORKERS):
        assert resumed[0].steps(rank) == list(range(STUCK_AFTER + 1, STEPS + 1))
        expected = reference[0].losses(rank)
        assert resumed[0].losses(rank) == {step: expected[step] for step in range(STUCK_AFTER + 1, STEPS + 1)}
        assert_same_parameters(resumed[0].final(rank), reference[0].final(rank))


def test_without_ft_plugins_the_same_hang_still_waits_and_keeps_no_step_past_the_last_save(
        alone: dict[str, object]) -> None:
    assert alone["alive"] == [True, True]
    assert alone["steps"] == [STUCK_AFTER, STUCK_AFTER]
    assert alone["latest"] == (2, 4)  # step 12: steps 13 and 14 would be lost
    assert alone["said"] == []
