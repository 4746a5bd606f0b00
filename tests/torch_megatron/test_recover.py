"""In-place recovery (``recover``) on real 4-rank torchrun runs of Megatron's ``pretrain()`` (CPU, gloo),
launched as ``ft-plugins run -- torchrun ...``, each against the uninterrupted run.

DP=4, one run, three faults in sequence, one warm spare per node (``FT_PLUGINS_RECOVER_SPARES=1``), a
periodic save every 3 steps: rank 1 killed in forward after 2 completed steps (a spare forked by the
template started with the job takes over, and a spare each later fault's); rank 0 killed in the save of
step 3 (every rank runs that save again after the repair: the save on disk is the uninterrupted run's);
rank 3 killed inside its optimizer update in step 5 (the survivors had finished their update: they count
step 5 as done and stand at 5). The survivors keep their processes, and the job ends with exit 0 and a
final save bit for bit the uninterrupted run's (RNG included), with no checkpoint read and no other
written on the way.

TP=2 x DP=2, one run: rank 1 killed inside its update in step 3; every survivor is caught after its own
update (rank 0 in the model-parallel check of the update with rank 1, ranks 2 and 3 in the loss
all-reduce), so step 3 counts as done; the replacement starts a step earlier to log step 3 with them,
rank 3 sends it the state of shard ``mp_rank_01``, the groups are rebuilt as Megatron built them, and
both shards of the final save are bit for bit the uninterrupted run's.

What falls back to ``ttp``'s dump of the last completed step, bit for bit a save of that step: a
replacement that never joins (the survivors wait for the bound), a replacement killed while it joins
(the launcher refuses the second fault and tells the survivors at once), an exception in a rank (not a
lost process: nothing to replace; its peers learn it at once instead of waiting for the bound). Without
ft_plugins the same kill ends the job.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from support import wait_gone
from ttp_runs import (DP4, ITERS, SHARDS, TP, Job, Launch, children_started, committed_dump, probing_children,
                      run_supervised, same_as_reference)

RECOVER = {"FT_PLUGINS": "ttp,recover"}
INTERVAL = 3  # the chained run's periodic saves: steps 3 and 6
# rank 1 killed in forward after 2 completed steps, rank 0 in the save of step 3, rank 3 inside step 5's update
FIRST, SAVED, UPDATED = 2, 3, 4
FAULTS = (f"rank=1,step={FIRST},kind=kill;rank=0,step={SAVED},kind=kill,at=save;"
          f"rank=3,step={UPDATED},kind=kill,at=update")
LAGGED = 2  # TP: rank 1 killed inside its update in the step after 2 completed steps


def _run(workdir: Path, *args: str, launch: Launch = DP4, interval: int = 100, **env: str) -> Job:
    """``ft-plugins run -- torchrun --nproc-per-node 4 ...`` on the Megatron example."""
    return run_supervised(workdir, launch, "--save-interval", str(interval), *args, **env)


def _catchers(job: Job, rank: int) -> list[str]:
    """The pid of every catch of a fault by ``rank``, in order."""
    return re.findall(rf"recover: rank {rank} \(pid (\d+)\) caught", job.output)


@pytest.fixture(scope="module")
def reference(dp4_reference: Job) -> Job:
    """Uninterrupted, without ft_plugins, saving every step (shared with the MindIO engine's recovery)."""
    return dp4_reference


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("recovered"), interval=INTERVAL, **RECOVER, FT_PLUGINS_INJECT_FAULT=FAULTS,
                FT_PLUGINS_RECOVER_SPARES="1")


@pytest.fixture(scope="module")
def lagged(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _run(tmp_path_factory.mktemp("tp_lagged"), launch=TP, **RECOVER,
                FT_PLUGINS_INJECT_FAULT=f"rank=1,step={LAGGED},kind=kill,at=update")


def test_three_ranks_lost_in_turn_the_job_ends_with_exit_0_and_the_uninterrupted_runs_weights(
        recovered: Job, reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert len(recovered.lines("firing injected fault")) == 3
    assert recovered.tracker() == str(ITERS)
    assert same_as_reference(recovered, reference, ITERS) == []  # model, optimizer, scheduler, RNG, counters


def test_only_the_lost_worker_is_replaced_the_survivors_keep_their_processes(recovered: Job) -> None:
    assert len(_catchers(recovered, 2)) == 3 and len(set(_catchers(recovered, 2))) == 1, "same process each time"
    one = re.search(r"rank 1 exited with code -9; (?:warm spare|replacement) pid (\d+)", recovered.output)
    assert one and _catchers(recovered, 1) == [one.group(1)] * 2, "rank 1's replacement survived two faults"
    takers = re.findall(r"exited with code -9; (warm spare|replacement) pid", recovered.output)
    assert "warm spare" in takers, "a warm spare took over (the first fault's, unless the template was importing)"
    first = takers.index("warm spare")
    assert takers[first:] == ["warm spare"] * (3 - first), "once the template is ready, a forked spare takes each"
    zero = re.search(r"rank 0 exited with code -9; (?:warm spare|replacement) pid (\d+)", recovered.output)
    assert zero and _catchers(recovered, 0)[1:] == [zero.group(1)], "rank 0's replacement survived the third fault"
    assert len(_catchers(recovered, 3)) == 2 and len(set(_catchers(recovered, 3))) == 1
    assert len(recovered.lines("took over as generation") + recovered.lines("started as generation")) == 3
    assert not recovered.lines(" rank ?]"), "the spare template, nobody's rank, says nothing"
    assert not recovered.lines("closing signal"), "torchrun never signalled a worker"
    for rank, generation in ((1, 1), (0, 2), (3, 3)):
        assert recovered.lines(f"rank {rank} joined generation {generation}")
    for step in (FIRST, SAVED, UPDATED + 1):
        assert recovered.lines(f"every rank stands at step {step}, training continues at step {step + 1}")


def test_a_rank_lost_in_a_periodic_save_every_rank_saves_that_step_again(recovered: Job, reference: Job) -> None:
    for survivor in (1, 2, 3):
        assert recovered.lines(f"recover: rank {survivor} (pid"), recovered.output[-5000:]
        assert [line for line in recovered.lines(f"recover: rank {survivor} (pid")
                if f"in the save of step {SAVED} ({SAVED} steps completed here)" in line]
    assert same_as_reference(recovered, reference, SAVED) == [], "the save written again is the uninterrupted one"


def test_a_rank_lost_inside_its_update_the_survivors_count_the_step_as_done(recovered: Job) -> None:
    for survivor in (0, 1, 2):  # caught in step 5's loss all-reduce, after their own update
        assert [line for line in recovered.lines(f"recover: rank {survivor} (pid")
                if f"in step {UPDATED + 1} ({UPDATED + 1} steps completed here)" in line], recovered.output[-5000:]


def test_no_checkpoint_read_or_written_on_the_way(recovered: Job) -> None:
    assert not recovered.lines("loading checkpoint"), "the replacements read nothing from disk"
    assert sorted(path.name for path in recovered.save.iterdir()) == ["ft_events", "ft_write_speed.json",
        "iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"], "the periodic saves only"
    assert not recovered.lines("dumped"), "no dying-gasp dump"


def test_every_step_trained_once(recovered: Job, lagged: Job) -> None:
    for job in (recovered, lagged):
        assert [len(job.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS


def test_tensor_parallel_a_rank_lost_inside_its_update_is_replaced_and_both_shards_end_bit_identical(
        lagged: Job, tp_reference: Job) -> None:
    assert lagged.returncode == 0, lagged.output[-5000:]
    for rank in (0, 2, 3):  # each caught after its own update of step 3 (a model-parallel or the loss collective)
        [caught] = lagged.lines(f"recover: rank {rank} (pid")
        assert f"in step {LAGGED + 1} ({LAGGED + 1} steps completed here)" in caught, caught
    # it starts a step earlier and counts that step as done by its peers, so that it logs it with them
    assert lagged.lines(f"replacement of rank 1 (generation 1) starts at step {LAGGED + 1}, as the survivors")
    assert lagged.lines(f"rank 3 sent the state of step {LAGGED + 1}"), "the other holder of mp_rank_01 sends"
    assert lagged.lines(f"every rank stands at step {LAGGED + 1}, training continues at step {LAGGED + 2}")
    assert not lagged.lines("loading checkpoint") and not lagged.lines("dumped")
    for shard in SHARDS:
        assert same_as_reference(lagged, tp_reference, ITERS, shard=shard) == [], shard


def test_a_replacement_that_never_joins_bounded_wait_then_the_dump_is_committed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job = _run(tmp_path_factory.mktemp("never_joins"), **RECOVER,
               FT_PLUGINS_RECOVER_TIMEOUT="15",
               FT_PLUGINS_INJECT_FAULT=f"rank=1,step={FIRST},kind=kill;rank=1,step=0,kind=hang,at=join,life=1")
    committed_dump(job, FIRST)
    for survivor in (0, 2, 3):
        assert job.lines(f"[ft_plugins.recover rank {survivor}] ERROR recover: generation 1 cannot recover: "
                         "the replacement did not come within 15 s; falling back to ttp's dump"), job.output[-4000:]
    assert job.lines("is not replaced: a second fault during recovery")
    assert same_as_reference(job, reference, FIRST) == []  # what a save at that step holds


def test_a_replacement_killed_while_it_joins_the_survivors_learn_it_then_the_dump_is_committed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    """Every worker starts a child that does not watch its parent (``fixtures/child_probe``): none is left once
    the job ended, the replacement's included (not replaced, its process group is still ended)."""
    workdir = tmp_path_factory.mktemp("killed_joining")
    children = workdir / "children.txt"
    job = _run(workdir, **probing_children(children, {
        **RECOVER, "FT_PLUGINS_INJECT_FAULT": f"rank=1,step={FIRST},kind=kill;rank=1,step=0,kind=kill,at=join,life=1"}))
    committed_dump(job, FIRST)
    assert job.lines("rank 1 exited with code -9 and is not replaced: a second fault during recovery")
    started = children_started(children)
    assert sorted(rank for rank, _ in started) == ["0", "1", "1", "2", "3"], started  # and rank 1's replacement
    wait_gone([child for _, child in started], timeout=10)  # none outlived the job (else killed, failed)
    assert same_as_reference(job, reference, FIRST) == []


def test_an_exception_in_a_rank_its_peers_fall_back_at_once_and_the_dump_is_committed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job = _run(tmp_path_factory.mktemp("raised"), **RECOVER, FT_PLUGINS_RECOVER_TIMEOUT="300",
               FT_PLUGINS_INJECT_FAULT=f"rank=2,step={FIRST},kind=exception")
    committed_dump(job, FIRST)
    assert job.lines("[ft_plugins.recover rank 2] ERROR recover: generation 1 cannot recover: rank 2 raised "
                     "InjectedFault"), job.output[-4000:]
    fell_back = job.lines("ERROR recover: generation 1 cannot recover:")
    assert all("rank 2 raised InjectedFault" in line for line in fell_back), fell_back  # never the bound
    assert job.lines("is not replaced: generation 1 was given up: rank 2 raised InjectedFault")
    assert not job.lines("replacement pid"), "nothing was lost, nothing replaced"
    assert same_as_reference(job, reference, FIRST) == []


def test_negative_control_without_ft_plugins_the_same_fault_ends_the_job(tmp_path_factory: pytest.TempPathFactory) -> None:
    job = _run(tmp_path_factory.mktemp("recover_control"), FT_PLUGINS="none",
               FT_PLUGINS_INJECT_FAULT=f"rank=1,step={FIRST},kind=kill")
    assert job.returncode != 0
    assert job.tracker() is None, "nothing saved: every completed step lost"
    assert job.lines("closing signal SIGTERM"), "torchrun stopped every worker"


@pytest.mark.parametrize("layout, refusal", [
    ({}, ""),
    ({"use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2}, ""),
    ({"use_distributed_optimizer": True},
     "megatron's distributed optimizer in one instance: a lost rank's optimizer shard has no other holder "
     "(FT_PLUGINS_TTP_REPLICAS=2, or --num-distributed-optimizer-instances 2)"),
    ({"pipeline_model_parallel_size": 2}, ""),
    ({"num_experts": 2}, ""),
    ({"num_experts": 2, "use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2},
     "mixture of experts with megatron's distributed optimizer: the experts' optimizer shards are not handed over "
     "yet"),
    ({"virtual_pipeline_model_parallel_size": 2}, ""),
    ({"ckpt_format": "torch_dist"}, ""),
    ({"ckpt_format": "fsdp_dtensor"},
     "--ckpt-format fsdp_dtensor: the hand-over moves the state of Megatron's DDP and optimizers as the torch and "
     "torch_dist formats save it"),
], ids=["data-parallel", "distributed-optimizer-two-instances", "distributed-optimizer-one-instance",
        "pipeline", "moe", "moe-distributed-optimizer", "virtual-pipeline", "torch-dist", "fsdp-dtensor"])
def test_what_recover_cannot_replace_is_said_at_the_start(layout: dict, refusal: str) -> None:
    from ft_plugins.torch.megatron.handover import unsupported

    megatron_args = SimpleNamespace(**{"pipeline_model_parallel_size": 1, "use_distributed_optimizer": False,
                                       "num_distributed_optimizer_instances": 1, **layout})
    assert unsupported(megatron_args) == refusal


def test_virtual_pipeline_stages_keep_each_chunks_batches_and_read_them_again_together() -> None:
    """One data iterator per model chunk (megatron's RerunDataIterator keeps its place, reading through ours):
    a step run again reads each chunk's batches again; a step done by a peer skips each chunk's unread ones."""
    from types import SimpleNamespace

    from ft_plugins.torch.megatron.handover import Chunks, kept

    rerun = SimpleNamespace(iterable=iter(range(100, 110)))
    batches, given = kept([iter(range(10)), rerun])
    assert isinstance(batches, Chunks) and given[1] is rerun and given[1].iterable is batches.members[1]
    plain = given[0]
    batches.begin_step()
    assert [next(plain), next(plain), next(rerun.iterable)] == [0, 1, 100]
    batches.rewind()
    assert [next(plain), next(plain), next(rerun.iterable), next(rerun.iterable)] == [0, 1, 100, 101]
    batches.begin_step()
    next(plain)
    batches.finish(3)  # each chunk read past the rest of the step's 3 batches
    assert [next(plain), next(rerun.iterable)] == [5, 105]


def test_train_called_again_on_the_same_iterators_reuses_their_batches_with_the_step_kept() -> None:
    """MindIO's exception handler calls ``train`` again on the objects it first gave: the second ``kept`` reads
    through the same :class:`Batches` (a step's batches kept by the first are read again), for one iterator or one
    per model chunk (megatron's RerunDataIterator among them); a replacement's chunks skip what was consumed."""
    from types import SimpleNamespace

    from ft_plugins.torch.megatron.handover import kept

    def read(given: Any) -> list[int]:
        return [next(getattr(member, "iterable", member)) for member in (given if isinstance(given, list) else [given])]

    plain, rerun = iter(range(10)), SimpleNamespace(iterable=iter(range(100, 110)))
    for iterator in (plain, [plain, rerun]):
        first, given = kept(iterator)
        first.begin_step()
        before = read(given)
        first.rewind()
        assert read(kept(iterator, first)[1]) == before
    chunks, given = kept([iter(range(10)), SimpleNamespace(iterable=iter(range(100, 110)))])
    chunks.skip(4)
    assert read(given) == [4, 104]


def test_a_survivor_receives_its_state_outside_ttps_lock_so_a_sigterm_dumps_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive blocked on a silent source must not hold the step tracker's lock: a SIGTERM's dump freezes the
    tracker under that lock, and would otherwise wait for the launcher's SIGKILL. The freeze is tried from another
    thread while the receive blocks."""
    import threading

    from ft_plugins.recovery import STEP, Plan
    from ft_plugins.steps import StepTracker
    from ft_plugins.torch.megatron import recover

    tracker = StepTracker()
    tracker.begin(4, "the state of step 4")
    frozen_meanwhile: list[Any] = []

    def receive(source: int, group: Any) -> dict[str, Any]:
        freezing = threading.Thread(target=lambda: frozen_meanwhile.append(tracker.freeze(0, exclusive=False)),
                                    daemon=True)
        freezing.start()
        freezing.join(5)
        return {"rng_state": None}

    stub = SimpleNamespace(get_data_parallel_group_gloo=lambda **_: "group", get_num_microbatches=lambda: 1)
    monkeypatch.setattr(recover, "megatron", lambda name: stub)
    monkeypatch.setattr(recover, "receive", receive)
    monkeypatch.setattr(recover, "apply", lambda *args: None)
    monkeypatch.setattr(recover.loop, "rerun_anew", lambda: None)
    recovery = recover.MegatronRecovery.__new__(recover.MegatronRecovery)
    recovery.tracker, recovery.objects = tracker, (None, None, None)
    recovery.batches = SimpleNamespace(rewind=lambda: None)
    recovery._align = lambda phase, rng: None
    decided = Plan(4, {0: 0}, {0: (1,)}, resume=STEP)
    assert recovery._hand_over(1, decided, 0, (recover.Standing(-1, 4, 0, 0.0), None)) == recover.REPEAT
    assert [frozen.completed for frozen in frozen_meanwhile] == [4], "the freeze waited for the receive"
