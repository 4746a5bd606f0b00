"""In-place recovery with pipeline parallelism, in the shape of a production job: 8 ranks, TP=2 x PP=2 x DP=2, two
virtual pipeline stages per rank (4 layers, one per model chunk: Megatron's interleaved schedule, one data iterator
per chunk), fp16 with a dynamic loss scale that doubles every 2 steps (its scale, growth and hysteresis trackers move
with the optimizer's state), Megatron's distributed optimizer in 2 instances (one per data-parallel replica),
micro-batches of 1 so that two are in flight in each step; real ``ft-plugins run -- torchrun`` ``pretrain()`` on
CPU/gloo against the uninterrupted run.

One run, a rank lost in each stage: rank 3 (stage 0, tensor shard 1, replica 1) in the forward of step 2, and rank 4
(stage 1, tensor shard 0, replica 0, a writer of the final save) inside its optimizer update in step 4, when its
peers finish theirs (so every rank then stands at step 4). Each replacement receives its state from the rank at the
same stage and tensor shard of the other replica; every survivor, in either stage, drops the micro-batches in flight
and keeps its process. The final save (4 shards, model with the fp32 main parameters and moments in
``distrib_optim.pt``) is the uninterrupted run's bit for bit: rank 3's replacement trains four more steps, so main
parameters it received inexactly would have reached every replica through the gradients, and rank 4's replacement
writes its loss scaler into the final save.

MindIO's recovery handlers on 4 ranks, PP=2 x DP=2, bf16 (its stand-in's controller picks each lost rank's source
from the replica layouts the ranks reported): a rank lost in each stage, each repaired from its replica in the same

stage, the final save of both stages the uninterrupted run's bit for bit.

Megatron's sequence parallelism needs Transformer Engine's or Apex's layer norm (its local spec's torch
LayerNorm refuses it: "sequence parallel not supported by torch LayerNorm"), neither of which runs on CPU, so it
is not in this shape.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from support import assert_bit_identical
from ttp_runs import ITERS, Job, Launch, assert_no_step_logged_twice, run_supervised, run_with_mindio, same_as_reference

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

PIPELINE = Launch(8, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2",
                      "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--micro-batch-size", "1", "--global-batch-size", "4",
                      "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"),
                  (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),))
# Megatron's rank order (tp, dp, pp): [0, 1] stage 0 replica 0, [2, 3] stage 0 replica 1, [4, 5] stage 1 replica 0,
# [6, 7] stage 1 replica 1; the ranks at the same stage and tensor shard of the other replica hold the same state
FAULTS = "rank=3,step=1,kind=kill;rank=4,step=3,kind=kill,at=update"
SHARDS = ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return PIPELINE.reference(tmp_path_factory.mktemp("pipeline_reference"), "--save-interval", "100")  # the final


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("pipeline_recovered"), PIPELINE, "--save-interval", "100",
                          FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=FAULTS)


def test_a_rank_lost_in_each_stage_is_replaced_in_place_by_its_replica_in_the_same_stage(recovered: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert len(recovered.lines("firing injected fault")) == 2
    assert not recovered.lines("cannot be replaced") and not recovered.lines("dumped"), recovered.output[-5000:]
    sent = recovered.lines("sent the state of step")
    for sender, step, receiver, generation in ((1, 1, 3, 1), (6, 4, 4, 2)):  # step: what every rank completed
        assert [line for line in sent if f"rank {sender} sent the state of step {step} (" in line
                and line.endswith(f"to rank {receiver}")], (sender, step, receiver, sent)
        assert recovered.lines(f"recover: rank {receiver} joined generation {generation}")
    survivors = {rank for rank in range(8) if rank != 3}  # rank 3 was replaced before the second fault
    caught = {int(rank) for rank in re.findall(r"recover: rank (\d) \(pid \d+\) caught", recovered.output)}
    assert survivors - {4} <= caught, caught  # every survivor, in either stage, met a fault in its own process
    assert not recovered.lines("closing signal"), "torchrun never stopped a worker"
    assert [len(recovered.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS


def test_the_final_save_is_the_uninterrupted_runs_model_and_optimizer_state_bit_for_bit(recovered: Job,
                                                                                      reference: Job) -> None:
    assert sorted(path.name for path in recovered.iteration(ITERS).iterdir()) == sorted(SHARDS)
    for shard in SHARDS:
        assert same_as_reference(recovered, reference, ITERS, shard=shard) == [], shard
        assert_bit_identical(reference.iteration(ITERS) / shard / "distrib_optim.pt",
                             recovered.iteration(ITERS) / shard / "distrib_optim.pt", parts=None)


# MindIO's recovery handlers (its stand-in's controller in rank 0's process) on 4 ranks, PP=2 x DP=2, bf16:
# [0, 1] stage 0, [2, 3] stage 1, each rank's data-parallel group its replica layout. Rank 1 (stage 0) is lost as
# step 3 begins, rank 2 (stage 1) as step 5 begins; each is repaired from its replica in the same stage.
MINDIO_PIPELINE = Launch(4, ("--pipeline-model-parallel-size", "2", "--bf16", "--micro-batch-size", "1",
                             "--global-batch-size", "4"),
                         (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),))
MINDIO_FAULTS = "rank=1,step=2,kind=kill;rank=2,step=4,kind=kill"


@pytest.fixture(scope="module")
def mindio_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return MINDIO_PIPELINE.reference(tmp_path_factory.mktemp("pipeline_mindio_reference"), "--save-interval", "100")


@pytest.fixture(scope="module")
def mindio_repaired(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]]]:
    return run_with_mindio(tmp_path_factory.mktemp("pipeline_mindio_repaired"), MINDIO_PIPELINE, "--save-interval",
                           "100", FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=MINDIO_FAULTS)


def test_mindios_handlers_repair_a_rank_lost_in_each_stage_from_its_replica_in_the_same_stage(
        mindio_repaired: tuple[Job, list]) -> None:
    job, calls = mindio_repaired
    assert job.returncode == 0, job.output[-5000:]
    assert len(job.lines("firing injected fault")) == 2
    assert not [c for c in calls if c["api"].startswith("fake_processor_")], "no handler refused"
    assert not job.lines("refused") and not job.lines("dumped") and not job.lines("loading checkpoint")
    repairs = [c["args"][1] for c in calls if c["api"] == "fake_controller_repair"]
    for source, lost, step in ((0, 1, 2), (3, 2, 4)):
        assert any(f"'repair_type': 'send', 'src': [{source}], 'dst': [{lost}]" in repair for repair in repairs), \
            repairs
        assert job.lines(f"rank {source} sent the state of step {step} (")
        assert job.lines(f"every rank stands at step {step}, training continues at step {step + 1}")
    for rank in (0, 3):  # a survivor of both faults, in either stage, in its first process
        assert len(set(re.findall(rf"MindIO stop on rank {rank} \(pid (\d+)\)", job.output))) == 1
    assert_no_step_logged_twice(job)


def test_after_mindios_repairs_the_final_save_is_the_uninterrupted_runs_bit_for_bit(
        mindio_repaired: tuple[Job, list], mindio_reference: Job) -> None:
    job, _ = mindio_repaired
    for shard in ("mp_rank_00_000", "mp_rank_00_001"):  # model, the fp32 main parameters and moments, counters
        assert same_as_reference(job, mindio_reference, ITERS, shard=shard) == [], shard
