"""The built-in engine with Megatron's distributed optimizer and two replicas: 4 ranks, DP=4, R=2 (real
torchrun ``pretrain()``, gloo, ``--ckpt-format torch``; the CPU shim carries the distributed optimizer).

Instances are [0, 1] and [2, 3], each holding the whole optimizer state sharded in two. Rank 1 killed:
rank 0's instance cannot gather its state and writes nothing, the complete instance [2, 3] gathers
inside its own gloo group and writes ``model_optim_rng.pt`` and ``distrib_optim.pt``, bit for bit the
uninterrupted run's save of that step; plain ``--load`` ends bit-identical. One rank killed in each
instance: no instance can gather, nothing is committed, each survivor says why. The MindIO engine
(with the fake) reports the layout, R=2 over the data-parallel ranks, and its dump after rank 1's loss
is the same as the built-in engine's. In-place recovery (``recover`` under ``ft-plugins run``), one run
launched as ``torchrun -m pretrain_gpt`` with a warm spare, three faults (forward, a periodic save, an update):
each replacement, and a survivor that could not finish its step, receives its shard from the rank at the same
place of the other instance; the spare template is SIGKILLed once it handed out its first spare; the job ends with
exit 0, the save written again and the final save the uninterrupted run's, optimizer shards included; the same through
MindIO's recovery handlers (the stand-in's controller picks rank 3 from the replica layout reported).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ft_plugins.processes import status
from support import FAKES, assert_bit_identical, path_first, read_records
from report_check import check_faults
from ttp_runs import (ITERS, Job, Launch, committed_dump, resumed_to_the_end, run_supervised, run_with_mindio,
                      same_as_reference)

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

DISTRIBUTED = Launch(4, ("--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "8"))
FAR = ("--save-interval", "100")
TTP = {"FT_PLUGINS": "ttp,resume"}  # replicas: auto, 2 with DP=4
STEP = 3
OPTIMIZER = "mp_rank_00/distrib_optim.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Uninterrupted, without ft_plugins, the same two instances asked for on the command line."""
    return DISTRIBUTED.reference(tmp_path_factory.mktemp("replicated_reference"),
                                 "--num-distributed-optimizer-instances", "2")


def test_megatron_alone_trains_and_saves_the_distributed_optimizer_on_cpu(reference: Job) -> None:
    """What the CPU shim carries (examples/megatron_gpt/cpu_shim.py): every step trained and saved with
    the optimizer's own shards file; the resumes below show megatron's load of it is bit-identical."""
    assert [len(reference.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS
    assert all((reference.iteration(i) / OPTIMIZER).is_file() for i in range(1, ITERS + 1))


@pytest.fixture(scope="module")
def one_lost(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DISTRIBUTED.run(tmp_path_factory.mktemp("replicated_one_lost"), *FAR, **TTP,
                           FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


def test_the_complete_instance_dumps_model_and_optimizer_state_bit_for_bit(one_lost: Job, reference: Job) -> None:
    committed_dump(one_lost, STEP)
    assert one_lost.lines(f"rank 2 dumped mp_rank_00 of iteration {STEP}"), "the complete instance's first rank"
    assert one_lost.lines("rank 0 writes nothing: its optimizer instance cannot gather its state")
    assert same_as_reference(one_lost, reference, STEP) == []
    assert_bit_identical(reference.iteration(STEP) / OPTIMIZER, one_lost.iteration(STEP) / OPTIMIZER, parts=None)


def test_plain_load_resumes_and_ends_bit_identical_optimizer_shards_included(one_lost: Job, reference: Job) -> None:
    resumed = DISTRIBUTED.resume(one_lost, *FAR, **TTP)
    resumed_to_the_end(resumed, reference, STEP)
    assert_bit_identical(reference.iteration(ITERS) / OPTIMIZER, resumed.iteration(ITERS) / OPTIMIZER, parts=None)


def test_one_rank_lost_in_each_instance_nothing_committed_and_each_survivor_says_why(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Both kills must fire: a rank 2 still short of its kill when torchrun's stop (after rank 1's death) reaches it
    dumps on SIGTERM with its instance whole, and that dump is rightly committed. On a loaded machine that happens;
    the job runs again then (at most three times)."""
    for attempt in range(3):
        job = DISTRIBUTED.run(tmp_path_factory.mktemp("replicated_both_hit"), *FAR, **TTP,
                              FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill;rank=2,step={STEP},kind=kill")
        if len(job.lines("firing injected fault")) == 2:
            break
    else:
        pytest.fail("rank 2 was stopped by torchrun before its own kill fired, three times")
    assert job.returncode != 0
    assert job.tracker() is None and not list(job.save.glob("iter_*")), "nothing written, nothing committed"
    for survivor in (0, 3):
        assert job.lines(f"rank {survivor} writes nothing: its optimizer instance cannot gather its state"), \
            job.output[-3000:]


@pytest.fixture(scope="module")
def recover_gave_up(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """``recover`` first: rank 1 killed, its replacement killed while it joins; the launcher leaves the rest to
    torchrun, whose stop signals the survivors while ``recover`` holds their groups on torch's fake backend."""
    return run_supervised(tmp_path_factory.mktemp("replicated_recover_gave_up"), DISTRIBUTED, *FAR,
                          FT_PLUGINS="ttp,recover,resume",
                          FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill;rank=1,step=0,kind=kill,at=join,life=1")


def test_a_dump_after_recover_gave_up_holds_every_optimizer_shard_of_the_complete_instance(
        recover_gave_up: Job, reference: Job) -> None:
    """The held groups' collectives return at once, and a gather on them hands every slot the caller's own
    tensor: the incomplete instance's rank 0 "gathered" and wrote rank 0's optimizer shard twice, rank 1's
    nowhere. Each instance now meets in a real group of its members for the gather: rank 1 does not come."""
    job = recover_gave_up
    committed_dump(job, STEP)
    assert job.lines("is not replaced: a second fault during recovery"), job.output[-4000:]
    assert job.lines(f"rank 2 dumped mp_rank_00 of iteration {STEP}"), job.output[-4000:]
    assert job.lines("rank 0 writes nothing: its optimizer instance cannot gather its state (TimeoutError: rank 1 "
                     "of [0, 1] did not come within"), job.output[-4000:]
    assert same_as_reference(job, reference, STEP) == []
    assert_bit_identical(reference.iteration(STEP) / OPTIMIZER, job.iteration(STEP) / OPTIMIZER, parts=None)


@pytest.fixture(scope="module")
def mindio_one_lost(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("replicated_mindio")
    record = workdir / "mindio.jsonl"
    path = path_first(FAKES)
    job = DISTRIBUTED.run(workdir, *FAR, **TTP, PYTHONPATH=path, FT_FAKE_RECORD=str(record), TTP_ADDR="127.0.0.1",
                          FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")
    return job, read_records(record)


def test_mindio_engine_reports_two_replicas_over_the_data_parallel_ranks(mindio_one_lost: tuple[Job, list]) -> None:
    _, calls = mindio_one_lost
    reported = {c["rank"]: c["args"] for c in calls if c["api"] == "tft_set_optimizer_replica"}
    assert reported == {str(rank): [rank, repr([{"rank_list": [0, 1, 2, 3], "replica_cnt": 2, "replica_shift": 0}])]
                        for rank in range(4)}
    groups = {c["rank"]: c["args"] for c in calls if c["api"] == "tft_set_dp_group_info"}
    assert groups == {str(rank): [rank, repr([0, 1, 2, 3])] for rank in range(4)}


def test_mindio_driven_dump_of_the_complete_instance_is_the_same(mindio_one_lost: tuple[Job, list],
                                                                  reference: Job) -> None:
    job, _ = mindio_one_lost
    committed_dump(job, STEP)
    assert job.lines(f"MindIO dump of step {STEP}: rank 2 dumped mp_rank_00 of iteration {STEP}")
    assert same_as_reference(job, reference, STEP) == []
    assert_bit_identical(reference.iteration(STEP) / OPTIMIZER, job.iteration(STEP) / OPTIMIZER, parts=None)


# recover, one run with one warm spare and a periodic save every 3 steps, three faults in turn: rank 1 in
# forward after 2 completed steps, rank 0 in the save of step 3, rank 3 inside its update in step 5
FAULTS = "rank=1,step=2,kind=kill;rank=0,step=3,kind=kill,at=save;rank=3,step=4,kind=kill,at=update"


def _spare_command(pid: str, save: Path) -> bool:
    """Whether process ``pid`` runs the spare template's command for the job saving to ``save``."""
    command = Path("/proc", pid, "cmdline").read_bytes().split(b"\0")
    return b"ft_plugins.launch.spare" in command and str(save).encode() in command


def _template_children(save: Path) -> tuple[int, int] | None:
    """The spare template of the job saving to ``save``: (pid, how many children), or None while there is none.
    Its forks (the spares waiting, and those taken over as workers) have its command line too: the template is
    the one whose parent has not (the pids wrap around on a busy machine, so the lowest is not always it)."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or not _spare_command(proc.name, save):
                continue
            found = status(int(proc.name))
            if found is not None and not _spare_command(str(found[1]), save):
                return int(proc.name), len((proc / "task" / proc.name / "children").read_text().split())
        except OSError:
            continue
    return None


def _kill_the_template_once_it_handed_out_a_spare(save: Path, killed: list[int]) -> None:
    """SIGKILL the spare template once it has forked a spare in place of one it handed out (two children: the
    taken one, now a worker, and the new one)."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        found = _template_children(save)
        if found and found[1] >= 2:
            os.kill(found[0], signal.SIGKILL)
            killed.append(found[0])
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[int]]:
    """Launched as ``torchrun -m pretrain_gpt``: the warm spares run the module as ``python -m`` does. The spare
    template is killed once it handed out its first spare: that spare, a worker now, is the launcher's to wait for."""
    workdir, killed = tmp_path_factory.mktemp("replicated_recovered"), []
    watch = threading.Thread(target=_kill_the_template_once_it_handed_out_a_spare, args=(workdir / "ckpt", killed),
                             daemon=True)
    watch.start()
    job = run_supervised(workdir, DISTRIBUTED, "--save-interval", "3", module=True, FT_PLUGINS="ttp,recover",
                         FT_PLUGINS_RECOVER_SPARES="1", FT_PLUGINS_INJECT_FAULT=FAULTS)
    watch.join(timeout=1)
    return job, killed


def test_recover_three_ranks_lost_in_turn_each_shard_from_the_same_place_of_the_other_instance(
        recovered: tuple[Job, list[int]], reference: Job) -> None:
    recovered, killed = recovered
    assert len(killed) == 1, "the spare template was killed after it handed out a spare"
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert len(recovered.lines("firing injected fault")) == 3
    for sender, step, receiver in ((3, 2, 1), (2, 3, 0), (1, 5, 3), (0, 5, 2)):
        # rank 2 never finished step 5 (its instance's all-gather lost rank 3): rank 0, its replica, sends it
        assert [line for line in recovered.lines(f"rank {sender} sent the state of step {step} (")
                if line.endswith(f"to rank {receiver}")], (sender, step, receiver)
    survivors = {rank: recovered.lines(f"recover: rank {rank} (pid")[-1] for rank in (0, 1, 2)}  # step 5's fault
    assert [held in survivors[rank] for rank, held in (
        (0, "in step 5 (5 steps completed here)"), (1, "in step 5 (5 steps completed here)"),
        (2, "in step 5 (its state torn by an update left half done: a peer sends it the step)"))] == [True] * 3, \
        survivors  # survivors at different places: rank 2's update was cut short by its instance's all-gather
    caught = re.findall(r"recover: rank 2 \(pid (\d+)\) caught", recovered.output)
    assert len(caught) == 3 and len(set(caught)) == 1, "rank 2 survived the three faults in its own process"
    assert not recovered.lines("closing signal"), "torchrun never signalled a worker"
    assert recovered.lines("; warm spare pid"), recovered.lines("exited with code")  # a spare of the module took over
    for rank, generation in ((1, 1), (0, 2), (3, 3)):  # a warm spare's lines too name the rank it took over
        assert recovered.lines(f"[ft_plugins.recover rank {rank}] WARNING recover: rank {rank} joined generation "
                               f"{generation}"), recovered.output[-5000:]
    assert [len(recovered.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS
    assert not recovered.lines("loading checkpoint") and not recovered.lines("dumped")
    assert sorted(path.name for path in recovered.save.iterdir()) == ["ft_events", "ft_write_speed.json",
        "iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"], "the periodic saves only"
    for step in (3, ITERS):  # the save the lost rank 0 interrupted, written again, and the final one
        assert same_as_reference(recovered, reference, step) == [], step
        assert_bit_identical(reference.iteration(step) / OPTIMIZER, recovered.iteration(step) / OPTIMIZER, parts=None)


def test_the_report_names_the_three_faults_met_in_place_each_with_its_time_to_training_again(
        recovered: tuple[Job, list[int]]) -> None:
    check_faults(recovered[0], [(1, "death", "in place", 2), (0, "death", "in place", 3), (3, "death", "in place", 4)])


@pytest.fixture(scope="module")
def mindio_recovered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]]]:
    return run_with_mindio(tmp_path_factory.mktemp("replicated_mindio_recovered"), DISTRIBUTED, *FAR,
                           FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


def test_mindio_recovery_handlers_repair_rank_1_from_rank_3_and_end_bit_identical(
        mindio_recovered: tuple[Job, list], reference: Job) -> None:
    job, calls = mindio_recovered
    assert job.returncode == 0, job.output[-5000:]
    repairs = [c["args"][1] for c in calls if c["api"] == "fake_controller_repair"]
    assert any("'repair_type': 'send', 'src': [3], 'dst': [1]" in repair for repair in repairs), repairs
    assert not [c for c in calls if c["api"].startswith("fake_processor_")], "no handler refused"
    assert [c["args"] for c in calls if c["api"] == "fake_controller_fault"] == [[1]]  # the end is no fault
    assert len([c for c in calls if c["api"] == "tft_destroy_processor"]) == 4  # MindIO's end after training
    assert not job.lines("loading checkpoint") and not job.lines("dumped")
    assert same_as_reference(job, reference, ITERS) == []
    assert_bit_identical(reference.iteration(ITERS) / OPTIMIZER, job.iteration(ITERS) / OPTIMIZER, parts=None)
