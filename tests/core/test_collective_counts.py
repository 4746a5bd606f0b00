"""``hangs`` on an asynchronous backend: each rank counts the collectives it enters per process group, and a rank ahead
of a peer in a group waits for that peer, wherever its main thread stands.

Real gloo, three processes: after one collective together, rank 0 enters an all-reduce asynchronously and waits on
its work from its own frame (as a rank of NCCL or HCCL blocks at a host sync), rank 1 enters it synchronously, rank 2
is stopped (SIGSTOP) outside any collective. By frames alone rank 0 is a culprit too and would be ended (negative
control); by the counts only rank 2 is, and the watchdog ends it alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ft_plugins import progress
from ft_plugins.launch import node_counts, watchdog
from ft_plugins.launch.stalls import HANG, ahead, judge, main_frames, waits_on_peers
from ft_plugins.features.hangs import Hangs
from support import free_port

SETTINGS = {**{option.name: option.default for option in Hangs.options}, "warmup": 60.0, "grace": 1.0}

WORKER = """\
import os, signal, sys, time
import torch
import torch.distributed as dist
from ft_plugins import progress
from ft_plugins.patching import PatchSet
from ft_plugins.torch.collective_counts import CollectiveCounts

directory, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
assert progress.start(rank, {"FT_PLUGINS_PROGRESS": directory})
PatchSet("hangs", CollectiveCounts().patches(), lambda patch_set, error: None).apply()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
progress.report(progress.STEP, 1)
dist.all_reduce(torch.ones(1))  # step 1, together
progress.report(progress.STEP, 2)
print("ready", flush=True)
if rank == 0:
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()  # the wait of an asynchronous backend, outside torch's frames
elif rank == 1:
    dist.all_reduce(torch.ones(1))
else:
    os.kill(os.getpid(), signal.SIGSTOP)  # the hang: alive and silent, outside any collective (stacks: none)
"""


def test_a_rank_ahead_of_a_peer_in_a_group_waits_for_it_and_groups_seen_once_tell_nothing() -> None:
    world, pair, alone = progress.group_key([0, 1, 2]), progress.group_key([0, 1]), progress.group_key([2, 5])
    assert len({world, pair, alone}) == 3 and progress.group_key([0, 1]) == pair  # the same on every member
    assert ahead({0: {world: 7, pair: 3}, 1: {world: 7, pair: 3}, 2: {world: 6, alone: 9}}) == {0, 1}
    assert ahead({0: {pair: 4}, 1: {pair: 3}, 2: {alone: 1}}) == {0}  # rank 1 is behind in its pair
    assert ahead({0: {world: 7}, 1: {world: 7}, 2: {}}) == set()  # nothing to compare with
    assert ahead({0: {alone: 1}, 2: {world: 3}}) == set()


def test_a_worker_counts_per_group_into_its_file_and_a_repair_counts_anew(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from ft_plugins import progress\n"
            "progress.start(1, {'FT_PLUGINS_PROGRESS': sys.argv[1]})\n"
            "for key in (5, 5, 9) + tuple(range(100, 100 + progress.GROUP_SLOTS)):\n"
            "    progress.entered(key)\n"
            "print(progress.collectives(sys.argv[1], 1), flush=True)\n"
            "progress.report(progress.RECOVERY)\n"
            "progress.entered(9)\n"
            "print(progress.collectives(sys.argv[1], 1))\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    before, after = result.stdout.splitlines()
    expected = {5: 2, 9: 1, **{key: 1 for key in range(100, 100 + progress.GROUP_SLOTS - 2)}}  # slots full: no more
    assert eval(before) == expected and eval(after) == {9: 1}, result.stderr
    assert progress.collectives(str(tmp_path), 2) == {}


def test_a_collective_without_a_group_argument_runs_uncounted() -> None:
    from ft_plugins.torch.collective_counts import CollectiveCounts

    wrapper = CollectiveCounts().patches()[0].wrapper
    assert wrapper(lambda tensor, op=None: tensor * 2, None, (3,), {}) == 6  # a release that renamed it: not counted


def test_a_rank_ahead_of_a_rank_elsewhere_waits_for_it() -> None:
    world = progress.group_key([0, 1, 2, 3])
    assert ahead({0: {world: 5}, 1: {world: 5}}) == set()  # alike here: nothing told
    assert ahead({0: {world: 5}, 1: {world: 5}}, {world: 4}) == {0, 1}  # a rank of another node entered fewer
    assert ahead({0: {world: 5}, 1: {world: 5}}, {world: 5}) == set()


def test_a_node_publishes_while_its_ranks_stand_still_and_fresh_entries_alone_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    here, there = node_counts.NodeCounts(store, 0, 2), node_counts.NodeCounts(store, 1, 2)
    assert here.elsewhere() == {}  # no entry yet: nothing waited for
    there.publish({7: 4, 9: 1})
    there.publish({7: 5})  # within a second of the last: not written again
    assert here.elsewhere() == {7: 4, 9: 1} and there.elsewhere() == {}  # its own entry is not read
    there.withdraw()
    assert here.elsewhere() == {}
    there.publish({7: 6})
    monkeypatch.setattr(node_counts, "FRESH", -1.0)  # every entry stale: a launcher gone long ago
    assert here.elsewhere() == {}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory):
    directory, port = tmp_path_factory.mktemp("counts"), free_port()
    workers = {rank: subprocess.Popen([sys.executable, "-c", WORKER, str(directory), str(rank), str(port)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)}
    try:
        for worker in workers.values():
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready", worker.stderr.read()
        world, deadline = progress.group_key([0, 1, 2]), time.monotonic() + 60
        while progress.collectives(str(directory), 1).get(world) != 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 1 entering its all-reduce
        time.sleep(0.5)
        yield directory, workers
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.kill()
            worker.wait()


def test_real_gloo_counts_show_the_asynchronous_waiter_and_frames_alone_would_end_it(three_ranks) -> None:
    directory, workers = three_ranks
    entered = {rank: progress.collectives(str(directory), rank) for rank in workers}
    world = progress.group_key([0, 1, 2])
    assert {rank: counts.get(world) for rank, counts in entered.items()} == {0: 2, 1: 2, 2: 1}, entered
    dog = watchdog.Watchdog(SETTINGS, str(directory))
    now = time.monotonic()
    for rank, worker in workers.items():
        dog.watches[rank] = watchdog.Watch(worker.pid, now)
        dog.watches[rank].observe(progress.read(str(directory), rank), now, dog.bounds)
    stacks = dog.stacks(list(workers))
    frames = {rank: waits_on_peers(main_frames(stacks[rank], dog.watches[rank].record.thread)) for rank in workers}
    assert frames == {0: False, 1: True, 2: False}  # rank 0 waits from its own frame
    control = judge(list(workers), [], frames, repeated=False)
    assert control.kind == HANG and control.culprits == [0, 2]  # by frames alone: rank 0, innocent, ended too
    verdict = dog.look({rank: worker for rank, worker in workers.items()}, False,
                       now + 10 * SETTINGS["warmup"])
    assert verdict is not None and verdict.kind == HANG and verdict.culprits == [2] and verdict.victims == [0, 1]
    assert workers[2].wait(timeout=30) == -signal.SIGKILL  # SIGTERM waits, pending, on a stopped process
    assert workers[0].poll() is None and workers[1].poll() is None  # both still wait for it
