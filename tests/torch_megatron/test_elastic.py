"""Elastic training (``elastic``): a node lost for good, the survivors go on in place at the smaller data-parallel
size, bit for bit what Megatron's own resume at that size gives from a save of the last completed step.

Two torchrun agents as two nodes of 2 ranks (``--nnodes 1:2``, c10d rendezvous, each under ``ft-plugins run``),
Megatron's ``pretrain()`` on CPU (gloo), the ordinary optimizer. Rank 2 stands still in step 3 and its node is
SIGKILLed whole (agent and workers): no replacement can come.

- DP=4 -> 2: the survivors go on after ``FT_PLUGINS_ELASTIC_WAIT`` seconds; the saves of steps 3 (Megatron's own,
  at the change of micro-batches per rank) and 6, and the evaluations at steps 3 and 6 and at the end, equal, bit for bit (model, optimizer, scheduler, RNG, counters),
  those of Megatron's own resume at DP=2 from the uninterrupted DP=4 run's save of step 2; they differ from that
  run's own (the arithmetic at DP=2 is another: the comparison can fail). Every step read exactly its global batch
  (criterion S2): samples ``[(s-1)·G, s·G)``, each once, at the size that completed it.
- Rank 2 stands still inside its optimizer update of step 3 when its node is lost: the survivors finished theirs,
  count step 3 as done and go on from it, bit for bit Megatron's own resume at DP=2 from the save of step 3.
- Four nodes of one rank, DP=4 -> 3 -> 2: node 3 lost in step 3, node 2 in step 5 (the global batch 12 kept: 3, 4
  and 6 micro-batches per rank); the end is bit for bit Megatron's own resume at DP=3 from the DP=4 save of step 2,
  run to step 4, then its own resume at DP=2 from that save of step 4.
- Megatron's distributed optimizer in 2 instances (``FT_PLUGINS_TTP_REPLICAS=2``), bf16, DP=4 -> 2, the lost node
  holding one instance whole: the buffers and shards laid out again in place from the instance left; every later
  save, ``distrib_optim.pt`` whole, bit for bit Megatron's own resume at DP=2 from its DP=4 save of step 2; the node
  back in step 5, the workers' dump of step 4 from the shards laid out is Megatron's own DP=2 save of it, and the
  job grown back to DP=4 from it ends as Megatron's own DP=4 resume of that save; TP=2 x DP=4 on two nodes of 4
  ranks -> TP=2 x DP=2, both shards exact; PP=2 x DP=4 on four nodes of 2 ranks -> PP=2 x DP=2, the healthy stage 0
  of the two dropped replicas leaving, both stages exact; in torch_dist, each save read whole equal to Megatron's
  own torch_dist resume at DP=2 of the torch-format save of step 2 (its resume of its own torch_dist save fails).
- Four nodes of one rank, node 3 lost in step 3 and node 2 as it is about to rebuild the groups for the scale-in
  (a second fault): the survivors wait recover's timeout, not the groups' rendezvous's 10 minutes, dump step 2 (bit
  for bit the DP=4 save of it), and torchrun restarts the job on the two nodes left from the dump, bit for bit
  Megatron's own resume at DP=2.
- Four nodes of one rank, the global batch 4, node 3 lost: DP=3 does not divide it; with Megatron's own
  ``--decrease-batch-size-if-needed`` it becomes 3 (said in the line; megatron-core 0.19's evaluation batch too),
  every later step reads exactly its 3 samples, and the end and the evaluations are bit for bit Megatron's own
  resume at DP=3 with the same switch.
- On the test backend with NCCL's semantics (``tests/fakes/blocking_backend``), the same loss, DP=4 -> 2: the
  survivors' collectives with the lost node block; node 0's launcher sees the node gone from torchrun's rendezvous
  (no keep-alive) and announces it; the survivors abort, catch, scale in, and end bit for bit as Megatron's own
  resume at DP=2.
- Without ``elastic`` (negative control), the same loss: the survivors wait for a replacement until recover's
  timeout, then dump step 2 and the job ends; step 3 is never trained.
- MindCluster's ``elastic-training`` through MindIO (the stand-in's controller, ZIT on, in rank 0's process): the same
  loss, DP=4 -> 2, the distributed optimizer in 2 instances, bf16, no replacement within ``MINDIO_WAIT_MINDX_TIME``:
  stop and clean on the survivors, then the downgrade rebuild handler on each; rank 1 lost in step 5, MindIO's dump
  (its stop and clean first) of step 4, ``distrib_optim.pt`` whole, is bit for bit Megatron's own resume at DP=2.
  Without ``elastic`` its controller takes the dump of step 2 (bit for bit the DP=4 save of it) and the job ends
  (negative control). With TP=2 x DP=4, node 1 (two whole replicas) lost: TP=2 x DP=2 to the end, both shards
  bit for bit Megatron's own resume; each rank's new data-parallel group reported to MindIO again. With PP=2 x DP=4,
  node 3 (stage 1 of two replicas) lost: their stage 0 ended by ClusterD's faultNodesExit, PP=2 x DP=2 to the end,
  both stages bit for bit Megatron's own resume; ranks 4 and 5 report their groups in MindIO's numbering.
- The lost node comes back after the scale-in (while rank 0 stands in the save of step 3): torchrun's agent stops
  its two workers, which dump step 3 (SIGTERM), and starts the job again at DP=4 with the node back, from that dump;
  the end is bit for bit Megatron's own resume at DP=4 from Megatron's own save of step 3 at DP=2. A rank killed
  after that is replaced in place again (the protocol starts afresh with each set of workers torchrun starts).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from elastic_runs import Nodes, elastic_job
from support import FAKES, assert_bit_identical, free_port, path_first, read_records
from ttp_runs import DP4, ITERS, SHARDS, TP, Job, Launch, differences, dist_differences

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

COMPLETED = 2  # steps completed when the node is lost (rank 2 stands still in step 3)
LOSS = {"FT_PLUGINS_INJECT_FAULT": f"rank=2,step={COMPLETED},kind=stuck"}
ELASTIC = {"FT_PLUGINS": "ttp,recover,elastic", "FT_PLUGINS_ELASTIC_WAIT": "3", **LOSS}
BATCH = 4  # the global batch: DP4's
DP2 = Launch(2, DP4.args)
# Megatron's order (dp, then pp): ranks 0 and 1 stage 0 of replicas 0 and 1, ranks 2 and 3 their stage 1
PIPELINE = Launch(4, ("--pipeline-model-parallel-size", "2", "--bf16", "--micro-batch-size", "1",
                      "--global-batch-size", "4"), (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),))
STAGES = ("mp_rank_00_000", "mp_rank_00_001")
SHARDED = ("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")  # ttp's replicas, by hand
BATCH12 = ("--micro-batch-size", "1", "--global-batch-size", "12")  # whole at DP=4, 3 and 2
ROUNDING = "--decrease-batch-size-if-needed"  # Megatron's own: a global batch the size does not divide, rounded down
DIST = ("--ckpt-format", "torch_dist")  # Megatron-LM's default format
EVALUATED = ("--eval-iters", "1", "--eval-interval", "3")  # evaluations at steps 3 and 6 (at DP=2) and at the end
AFTER_DOWNGRADE = COMPLETED + 2  # the steps completed when a rank is lost after MindIO's downgrade


def _megatron_resume(reference: Job, launch: Launch, workdir: Path, *args: str, step: int = COMPLETED) -> Job:
    """Megatron's own resume at ``launch``'s size from ``reference``'s save of ``step``, to the end, saving every step
    (no ft_plugins)."""
    load = workdir / "load"
    shutil.copytree(reference.iteration(step), load / reference.iteration(step).name)
    (load / "latest_checkpointed_iteration.txt").write_text(str(step))
    job = launch.run(workdir, "--load", str(load), "--save-interval", "1", *args, save=workdir / "ckpt",
                     FT_PLUGINS="none")
    assert job.returncode == 0, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, Path]:
    workdir = tmp_path_factory.mktemp("scaled")
    samples = workdir / "samples"
    job = elastic_job(workdir, "--train-iters", str(ITERS), "--ft-sample-log", str(samples), *EVALUATED, lose=(2,),
                      **ELASTIC)
    return job, samples


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    return elastic_job(tmp_path_factory.mktemp("blocked"), "--train-iters", str(ITERS), lose=(2,),
                       PYTHONPATH=path_first(FAKES / "blocking_backend"), FT_FAKE_BLOCKING="1", **ELASTIC)


def _under_mindio(workdir: Path, plugins: str, *shape: str, lose: int = 2, nodes: int = 2, per_node: int = 2,
                  **env: str) -> tuple[Nodes, list[dict]]:
    """The loss of rank ``lose``'s node in step 3 (DP=4, or ``shape``: Megatron's parallel sizes) under MindIO's
    stand-in (ZIT on with ``elastic``), its controller in rank 0's process and the processors of both nodes on one
    channel, in the shape MindSpeed-LLM's elastic training asks for: the distributed optimizer (in 2 instances: the
    lost node's has a replica), bf16; the calls it recorded."""
    record = workdir / "mindio.jsonl"
    loss = {"FT_PLUGINS_INJECT_FAULT": f"rank={lose},step={COMPLETED},kind=stuck"}
    job = elastic_job(workdir, "--train-iters", str(ITERS), "--distributed-timeout-minutes", "2", *shape, SHARDED[0],
                      "--bf16", lose=(lose,), nodes=nodes, per_node=per_node,
                      **{**ELASTIC, **loss, "FT_PLUGINS": plugins, **env}, FT_PLUGINS_TTP_REPLICAS="2",
                      PYTHONPATH=path_first(FAKES), FT_FAKE_RECORD=str(record),
                      FT_FAKE_MINDIO_CHANNEL="elastic", TTP_ADDR="127.0.0.1", TTP_PORT=str(free_port()),
                      MINDIO_WAIT_MINDX_TIME="3")
    return job, read_records(record)


@pytest.fixture(scope="module")
def downgraded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, list[dict]]:
    """Scaled in at step 3; rank 1 killed as step 5 begins: after a downgrade MindIO takes the dump (its stop and
    clean first)."""
    faults = f"{LOSS['FT_PLUGINS_INJECT_FAULT']};rank=1,step={AFTER_DOWNGRADE},kind=kill"
    return _under_mindio(tmp_path_factory.mktemp("downgraded"), "ttp,recover,elastic", FT_PLUGINS_INJECT_FAULT=faults)


@pytest.fixture(scope="module")
def downgraded_tp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, list[dict]]:
    """TP=2 x DP=4 on two nodes of 4 ranks: node 1 (ranks 4 to 7, two whole model replicas, one optimizer instance)
    lost in step 3; MindIO's downgrade, then ranks 0 to 3 train to the end at TP=2 x DP=2."""
    return _under_mindio(tmp_path_factory.mktemp("downgraded_tp"), "ttp,recover,elastic", *TP.args, lose=4,
                         per_node=4, **dict(TP.env))


@pytest.fixture(scope="module")
def downgraded_pp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, list[dict]]:
    """PP=2 x DP=4 on four nodes of 2 ranks: node 3 (stage 1 of replicas 2 and 3, ranks 6 and 7) lost in step 3;
    MindIO isolates their stage 0 too (node 1, ranks 2 and 3: ClusterD's faultNodesExit ends them) and ranks 0, 1, 4
    and 5 train to the end at PP=2 x DP=2."""
    return _under_mindio(tmp_path_factory.mktemp("downgraded_pp"), "ttp,recover,elastic", *PIPELINE.args, lose=6,
                         nodes=4, **dict(PIPELINE.env))


@pytest.fixture(scope="module")
def not_downgraded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, list[dict]]:
    # the lost node's rank asked to stop never answers: MindIO's bound on it (180 s by default), shorter
    return _under_mindio(tmp_path_factory.mktemp("not_downgraded"), "ttp,recover", TTP_NORMAL_ACTION_TIME_LIMIT="10")


@pytest.fixture(scope="module")
def resumed_at_dp2(dp4_reference: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _megatron_resume(dp4_reference, DP2, tmp_path_factory.mktemp("resumed_at_dp2"))


@pytest.fixture(scope="module")
def evaluated_dp4(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The uninterrupted DP=4 run evaluating as the scaled-in runs do (a job with a validation set draws once more
    from torch's generator as it builds its data iterators)."""
    return DP4.reference(tmp_path_factory.mktemp("evaluated_dp4"), *EVALUATED)


@pytest.fixture(scope="module")
def evaluated_at_dp2(evaluated_dp4: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Megatron's own resume at DP=2, from the evaluating DP=4 run's save of step 2."""
    return _megatron_resume(evaluated_dp4, DP2, tmp_path_factory.mktemp("evaluated_at_dp2"), *EVALUATED)


@pytest.fixture(scope="module")
def dist_sharded_scaled(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    return elastic_job(tmp_path_factory.mktemp("dist_sharded_scaled"), "--train-iters", str(ITERS), *DIST, SHARDED[0],
                       "--bf16", lose=(2,), FT_PLUGINS_TTP_REPLICAS="2", **ELASTIC)


@pytest.fixture(scope="module")
def regrown(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, Path]:
    """Scaled in at step 3, the node back while rank 0 stands in Megatron's save of step 3 (at the change of
    micro-batches), rank 1 killed in step 5 of the job grown back."""
    workdir = tmp_path_factory.mktemp("regrown")
    faults = (f"{LOSS['FT_PLUGINS_INJECT_FAULT']};rank=0,step={COMPLETED + 1},kind=slow,at=save,seconds=120;"
              f"rank=1,step={COMPLETED + 2},kind=kill")
    nodes = elastic_job(workdir, "--train-iters", str(ITERS), "--load", str(workdir / "ckpt"), "--ft-sample-log",
                      str(workdir / "samples"), lose=(2,), rejoin=f"firing injected fault rank=0,step={COMPLETED + 1}",
                      **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": faults})
    return nodes, workdir / "samples"


@pytest.fixture(scope="module")
def in_update(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """Rank 2 stands still inside its optimizer update of step 3: the survivors finish theirs, and are caught after."""
    return elastic_job(tmp_path_factory.mktemp("in_update"), "--train-iters", str(ITERS), lose=(2,),
                     **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": f"rank=2,step={COMPLETED},kind=stuck,at=update"})


@pytest.fixture(scope="module")
def sharded_scaled(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    return elastic_job(tmp_path_factory.mktemp("sharded_scaled"), "--train-iters", str(ITERS), SHARDED[0], "--bf16",
                       lose=(2,), FT_PLUGINS_TTP_REPLICAS="2", **ELASTIC)


@pytest.fixture(scope="module")
def sharded_regrown(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """The same, the node back while rank 0 stands still in step 5 (45 s, again in the job grown back: a fault fires
    on each attempt torchrun counts, and a change of nodes is not one): the workers dump the laid out shards of step
    4 on SIGTERM and torchrun starts the job again at DP=4 from that dump. (Not in a save: with 2 instances each
    rank writes its instance's ``distrib_optim.pt``, so a save a rank stands still in exists half-written, and a
    dump is never committed over it.)"""
    workdir = tmp_path_factory.mktemp("sharded_regrown")
    faults = f"{LOSS['FT_PLUGINS_INJECT_FAULT']};rank=0,step={COMPLETED + 2},kind=slow,at=forward,seconds=45"
    return elastic_job(workdir, "--train-iters", str(ITERS), "--load", str(workdir / "ckpt"), SHARDED[0], "--bf16",
                       lose=(2,), rejoin=f"firing injected fault rank=0,step={COMPLETED + 2}",
                       FT_PLUGINS_TTP_REPLICAS="2", **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": faults})


@pytest.fixture(scope="module")
def sharded_tp(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """TP=2 x DP=4 on two nodes of 4 ranks, the distributed optimizer in 2 instances, bf16: node 1 (ranks 4 to 7, two
    model replicas, one instance) lost in step 3."""
    return elastic_job(tmp_path_factory.mktemp("sharded_tp"), "--train-iters", str(ITERS), *TP.args, SHARDED[0],
                       "--bf16", per_node=4, lose=(4,), FT_PLUGINS_TTP_REPLICAS="2", **dict(TP.env),
                       **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": f"rank=4,step={COMPLETED},kind=stuck"})


@pytest.fixture(scope="module")
def sharded_tp_at_dp2(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Megatron's own resume at TP=2 x DP=2 of its TP=2 x DP=4 save of step 2 (the distributed optimizer in 2
    instances, bf16)."""
    shape = (*TP.args, *SHARDED, "--bf16")
    reference = Launch(8, shape, TP.env).reference(tmp_path_factory.mktemp("sharded_tp_reference"), *DP4.args)
    return _megatron_resume(reference, Launch(4, shape, TP.env), tmp_path_factory.mktemp("sharded_tp_at_dp2"),
                            *DP4.args)


@pytest.fixture(scope="module")
def sharded_pp_at_dp2(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Megatron's own resume at PP=2 x DP=2 of its PP=2 x DP=4 save of step 2 (the distributed optimizer in 2
    instances, bf16)."""
    shape = (*PIPELINE.args, *SHARDED)
    reference = Launch(8, shape, PIPELINE.env).reference(tmp_path_factory.mktemp("sharded_pp_reference"))
    return _megatron_resume(reference, Launch(4, shape, PIPELINE.env), tmp_path_factory.mktemp("sharded_pp_at_dp2"))


@pytest.fixture(scope="module")
def sharded_pipelined(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """PP=2 x DP=4 on four nodes of 2 ranks, the distributed optimizer in 2 instances, bf16: node 3 (stage 1 of
    replicas 2 and 3, ranks 6 and 7) lost in step 3; node 1 holds their stage 0 (ranks 2 and 3)."""
    return elastic_job(tmp_path_factory.mktemp("sharded_pipelined"), "--train-iters", str(ITERS), *PIPELINE.args,
                       SHARDED[0], nodes=4, lose=(6,), FT_PLUGINS_TTP_REPLICAS="2", **dict(PIPELINE.env),
                       **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": f"rank=6,step={COMPLETED},kind=stuck"})


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DP4.reference(tmp_path_factory.mktemp("sharded_reference"), *SHARDED, "--bf16")


@pytest.fixture(scope="module")
def sharded_at_dp2(sharded_reference: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _megatron_resume(sharded_reference, DP2, tmp_path_factory.mktemp("sharded_at_dp2"), *SHARDED, "--bf16")


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    faults = f"rank=3,step={COMPLETED},kind=stuck;rank=2,step={COMPLETED + 2},kind=stuck"
    return elastic_job(tmp_path_factory.mktemp("twice"), "--train-iters", str(ITERS), "--global-batch-size", "12",
                       nodes=4, per_node=1, lose=(3, 2), **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": faults})


@pytest.fixture(scope="module")
def lost_in_scale_in(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """Node 3 lost in step 3; node 2 lost as its rank is about to build the groups of the scale-in."""
    workdir = tmp_path_factory.mktemp("lost_in_scale_in")
    faults = f"rank=3,step={COMPLETED},kind=stuck;rank=2,step=0,kind=stuck,at=regroup"
    return elastic_job(workdir, "--train-iters", str(ITERS), "--global-batch-size", "12", "--load",
                       str(workdir / "ckpt"), nodes=4, per_node=1, lose=(3, 2), restarts=1, last_call=10,
                       FT_PLUGINS_RECOVER_TIMEOUT="10", **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": faults})


@pytest.fixture(scope="module")
def rounded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, Path]:
    """Four nodes of one rank, the global batch 4, node 3 lost: DP=3 does not divide it, Megatron's own
    ``--decrease-batch-size-if-needed`` makes it 3."""
    workdir = tmp_path_factory.mktemp("rounded")
    samples = workdir / "samples"
    job = elastic_job(workdir, "--train-iters", str(ITERS), "--ft-sample-log", str(samples), ROUNDING, *EVALUATED,
                      nodes=4,
                      per_node=1, lose=(3,), **{**ELASTIC, "FT_PLUGINS_INJECT_FAULT": f"rank=3,step={COMPLETED},kind=stuck"})
    return job, samples


@pytest.fixture(scope="module")
def dp4_batch12(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Launch(4, BATCH12).reference(tmp_path_factory.mktemp("dp4_batch12"))


@pytest.fixture(scope="module")
def waited(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """The same loss without ``elastic``."""
    return elastic_job(tmp_path_factory.mktemp("waited"), "--train-iters", str(ITERS), lose=(2,),
                     FT_PLUGINS="ttp,recover", FT_PLUGINS_RECOVER_TIMEOUT="10", **LOSS)


def test_a_lost_node_the_survivors_train_on_at_half_the_size_in_place(scaled: tuple[Nodes, Path]) -> None:
    nodes, _ = scaled
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert nodes.job.lines("elastic: no replacement within 3 s for ranks 2, 3: 2 ranks go on at data-parallel size 2 "
                           "(was 4), the global batch 4 kept")
    assert re.search(rf"rank 0 repaired generation 1 in [\d.]+ s: every rank stands at step {COMPLETED}", nodes.job.output)
    for step in range(1, ITERS + 1):  # no step lost, none twice
        assert len(nodes.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    assert not nodes.job.lines("loading checkpoint"), "no checkpoint read"
    assert not nodes.job.lines("falling back to ttp's dump")
    assert nodes.job.lines("elastic: torchrun's exit barrier waits for the 1 node left after the scale-in")


def test_the_scaled_in_run_is_megatrons_own_resume_at_the_smaller_size_bit_for_bit(
        scaled: tuple[Nodes, Path], evaluated_at_dp2: Job, dp4_reference: Job) -> None:
    nodes, _ = scaled
    model = "mp_rank_00/model_optim_rng.pt"
    saved = sorted(path.name for path in nodes.job.save.glob("iter_*"))
    assert saved == [f"iter_{COMPLETED + 1:07d}", f"iter_{ITERS:07d}"], saved  # Megatron's save at 1 -> 2 micro-batches
    for step in (COMPLETED + 1, ITERS):
        assert differences(nodes.job.iteration(step) / model, evaluated_at_dp2.iteration(step) / model) == [], step
    assert differences(nodes.job.iteration(ITERS) / model, dp4_reference.iteration(ITERS) / model), \
        "DP=2 and DP=4 sum the gradients in another order: equal to the DP=4 run would mean nothing was compared"


def _validation(job: Job) -> dict[str, str]:
    """Each evaluation's losses as Megatron prints them, by where it says it stands."""
    found = [re.search(r"validation loss at (.+?) \| (.+)$", line) for line in job.lines("validation loss at")]
    return {match.group(1): match.group(2) for match in found if match}


def test_the_evaluations_after_the_scale_in_read_what_megatrons_own_resume_reads(
        scaled: tuple[Nodes, Path], evaluated_at_dp2: Job) -> None:
    """The validation iterator is built again too, at the validation samples consumed: the evaluations at DP=2 print
    the losses of Megatron's own resume at DP=2 (the old iterator at the DP=4 layout reads other samples)."""
    nodes, _ = scaled
    evaluated, reference = _validation(nodes.job), _validation(evaluated_at_dp2)
    assert len(reference) == 3 and evaluated == reference, (evaluated, reference)


def _reads(samples: Path) -> dict[tuple[int, int], list[int]]:
    """(step, world size) -> the samples read in it at that size (``--ft-sample-log``), every attempt's."""
    reads: dict[tuple[int, int], list[int]] = defaultdict(list)
    for path in samples.glob("pid_*.txt"):
        for line in path.read_text().splitlines():
            step, world, _, *indices = map(int, line.split())
            reads[step, world] += indices
    return reads


def test_every_step_read_exactly_its_global_batch_at_the_size_that_completed_it(scaled: tuple[Nodes, Path]) -> None:
    _, samples = scaled
    reads = _reads(samples)
    for step in range(1, ITERS + 1):
        world = 4 if step <= COMPLETED else 2
        assert sorted(reads.pop((step, world))) == list(range((step - 1) * BATCH, step * BATCH)), step
    aborted = reads.pop((COMPLETED + 1, 4), [])  # the survivors' reads of step 3 before the loss: read again
    assert set(aborted) <= set(range(COMPLETED * BATCH, (COMPLETED + 1) * BATCH)) and not reads, (aborted, reads)


def test_the_scale_in_is_an_event(scaled: tuple[Nodes, Path]) -> None:
    nodes, _ = scaled
    found = [json.loads(line) for path in (nodes.job.save / "ft_events").glob("*-worker.jsonl")
             for line in path.read_text().splitlines() if '"scale_in"' in line]
    assert found and {(event["before"], event["data_parallel"], tuple(event["lost"])) for event in found} == {
        (4, 2, (2, 3))}, found


def test_the_report_shows_the_scale_in_and_the_throughput_at_each_size(scaled: tuple[Nodes, Path]) -> None:
    nodes, _ = scaled
    report = subprocess.run([sys.executable, "-m", "ft_plugins.cli", "report", "--json", str(nodes.job.save)],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    found = json.loads(report.stdout)
    assert [fault["how"] for fault in found["faults"]] == ["hang kill, scale-in 4 -> 2"], found["faults"]
    assert [(size["data_parallel"], size["steps"]) for size in found["sizes"]] == [(4, COMPLETED),
                                                                                   (2, ITERS - COMPLETED - 1)]
    assert found["faults"][0]["steps_lost"] == 0


def test_in_torch_dist_the_distributed_optimizers_saves_after_the_scale_in_are_megatrons_own_resume(
        dist_sharded_scaled: Nodes, sharded_reference: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--ckpt-format torch_dist`` with the distributed optimizer in 2 instances, bf16: Megatron saves the shards
    laid out again as its sharded state; read whole, each save equals Megatron's own resume at DP=2, in torch_dist,
    of the DP=4 run's save of step 2 in the torch format (megatron-core 0.17's resume of its own torch_dist save of it
    at DP=2 fails at its first save: the optimizer's step counts it loads differ between parameters)."""
    nodes = dist_sharded_scaled
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert len(nodes.job.lines("laid the distributed optimizer out for data-parallel size 2")) == 2
    resumed = _megatron_resume(sharded_reference, DP2, tmp_path_factory.mktemp("dist_sharded_at_dp2"), *SHARDED,
                               "--bf16", *DIST, "--auto-detect-ckpt-format")
    for step in (COMPLETED + 1, ITERS):
        assert dist_differences(nodes.job.iteration(step), resumed.iteration(step)) == [], step


def test_without_elastic_the_same_loss_waits_for_a_replacement_then_ends_in_the_dump(waited: Nodes) -> None:
    assert waited.codes[0] != 0
    assert waited.job.lines("the launcher's announcement of a replacement did not come within 10 s; falling back")
    assert waited.job.tracker() == str(COMPLETED)  # the dump of step 2
    assert not waited.job.lines(f"iteration        {COMPLETED + 1}/       {ITERS}")


def test_the_node_back_the_job_grows_back_from_the_dump_and_repairs_in_place_again(regrown: tuple[Nodes, Path]) -> None:
    nodes, _ = regrown
    assert nodes.codes == (0, -9, 0), nodes.outputs[0][-5000:]
    assert nodes.job.lines("2 ranks go on at data-parallel size 2 (was 4)")
    assert nodes.job.lines(f"dumped mp_rank_00 of iteration {COMPLETED + 1} in")
    assert nodes.job.lines(f"loading checkpoint from {nodes.job.save} at iteration {COMPLETED + 1}")
    assert re.search(rf"rank 0 repaired generation 1 in [\d.]+ s: every rank stands at step {COMPLETED + 2}",
                     nodes.job.output), "a loss in the job grown back is repaired in place"
    for step in range(COMPLETED + 2, ITERS + 1):
        assert len(nodes.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step


def test_grown_back_it_is_megatrons_own_resume_at_the_full_size_bit_for_bit(
        regrown: tuple[Nodes, Path], resumed_at_dp2: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    nodes, _ = regrown
    model, scaled_out = "mp_rank_00/model_optim_rng.pt", COMPLETED + 1
    assert differences(nodes.job.iteration(scaled_out) / model, resumed_at_dp2.iteration(scaled_out) / model) == []
    grown = _megatron_resume(resumed_at_dp2, DP4, tmp_path_factory.mktemp("resumed_at_dp4"), step=scaled_out)
    assert differences(nodes.job.iteration(ITERS) / model, grown.iteration(ITERS) / model) == []


def test_grown_back_every_step_read_its_global_batch_at_the_size_that_completed_it(
        regrown: tuple[Nodes, Path]) -> None:
    _, samples = regrown
    reads = _reads(samples)
    for step in range(1, ITERS + 1):
        world = 2 if step == COMPLETED + 1 else 4
        assert set(reads[step, world]) == set(range((step - 1) * BATCH, step * BATCH)), step  # step 5 read twice


def test_on_a_backend_that_blocks_the_launcher_announces_the_lost_node_and_the_survivors_scale_in_exactly(
        blocked: Nodes, resumed_at_dp2: Job) -> None:
    first, _ = blocked.outputs
    assert blocked.codes[0] == 0, first[-5000:]
    assert "without finishing: the workers' communicators are aborted for generation 1" in first, first[-5000:]
    for rank in (0, 1):
        assert blocked.job.lines(f"[ft_plugins.torch rank {rank}] WARNING aborted this rank's"), rank
        [caught] = blocked.job.lines(f"recover: rank {rank} (pid")
        assert "caught DistBackendError: blocking: " in caught, caught
    assert blocked.job.lines("elastic: no replacement within 3 s for ranks 2, 3: 2 ranks go on at data-parallel "
                             "size 2 (was 4), the global batch 4 kept")
    for step in range(1, ITERS + 1):
        assert len(blocked.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    model = "mp_rank_00/model_optim_rng.pt"
    assert differences(blocked.job.iteration(ITERS) / model, resumed_at_dp2.iteration(ITERS) / model) == []


def test_a_node_lost_inside_the_update_the_survivors_count_the_step_and_go_on_exactly(
        in_update: Nodes, dp4_reference: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert in_update.codes[0] == 0, in_update.outputs[0][-5000:]
    assert re.search(rf"rank 0 repaired generation 1 in [\d.]+ s: every rank stands at step {COMPLETED + 1}",
                     in_update.job.output), "step 3 was completed by every survivor"
    for step in range(1, ITERS + 1):
        assert len(in_update.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    resumed = _megatron_resume(dp4_reference, DP2, tmp_path_factory.mktemp("resumed_at_dp2_from_3"),
                               step=COMPLETED + 1)
    model = "mp_rank_00/model_optim_rng.pt"
    assert differences(in_update.job.iteration(ITERS) / model, resumed.iteration(ITERS) / model) == []


def _same_sharded_save(job: Job, reference: Job, step: int, shards: tuple[str, ...] = ("mp_rank_00",)) -> None:
    """Each of ``shards`` of ``job``'s save of ``step`` is ``reference``'s: its model file and ``distrib_optim.pt``."""
    for shard in shards:
        assert differences(job.iteration(step) / shard / "model_optim_rng.pt",
                           reference.iteration(step) / shard / "model_optim_rng.pt") == [], (step, shard)
        assert_bit_identical(job.iteration(step) / shard / "distrib_optim.pt",
                             reference.iteration(step) / shard / "distrib_optim.pt", parts=None)


def test_the_distributed_optimizer_is_laid_out_again_in_place_bit_for_bit_megatrons_own_resume(
        sharded_scaled: Nodes, sharded_at_dp2: Job) -> None:
    """Megatron's distributed optimizer in 2 instances (``FT_PLUGINS_TTP_REPLICAS=2``), bf16: the lost node held one
    instance whole; the survivors' buffers and shards are laid out again for DP=2 from the instance left, and every
    later save, ``distrib_optim.pt`` whole, is Megatron's own resume at DP=2 from its DP=4 save of step 2."""
    nodes = sharded_scaled
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert nodes.job.lines("2 ranks go on at data-parallel size 2 (was 4), the global batch 4 kept")
    assert len(nodes.job.lines("laid the distributed optimizer out for data-parallel size 2")) == 2
    for step in range(1, ITERS + 1):
        assert len(nodes.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    assert not nodes.job.lines("loading checkpoint"), "no checkpoint read"
    for step in (COMPLETED + 1, ITERS):
        _same_sharded_save(nodes.job, sharded_at_dp2, step)


def test_with_tensor_parallelism_each_shards_optimizer_is_laid_out_again_bit_for_bit(
        sharded_tp: Nodes, sharded_tp_at_dp2: Job) -> None:
    """TP=2 x DP=4 -> TP=2 x DP=2: each tensor-parallel rank's ranges move inside its own new data-parallel group;
    both shards' saves, ``distrib_optim.pt`` whole, are Megatron's own resume at TP=2 x DP=2."""
    nodes = sharded_tp
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert nodes.job.lines("4 ranks go on at data-parallel size 2 (was 4), the global batch 4 kept")
    _same_sharded_save(nodes.job, sharded_tp_at_dp2, ITERS, SHARDS)


def test_with_pipeline_stages_the_healthy_stage_leaves_and_each_stages_optimizer_is_laid_out_again(
        sharded_pipelined: Nodes, sharded_pp_at_dp2: Job) -> None:
    """PP=2 x DP=4 -> PP=2 x DP=2: ranks 2 and 3, the healthy stage 0 of the dropped replicas, leave (exit code 0,
    their node's agent done); both stages' saves, ``distrib_optim.pt`` whole, are Megatron's own resume at
    PP=2 x DP=2."""
    nodes = sharded_pipelined
    assert nodes.codes == (0, 0, 0, -9), nodes.outputs[0][-5000:]
    assert nodes.job.lines("elastic: rank 2 leaves the job") and nodes.job.lines("elastic: rank 3 leaves the job")
    assert nodes.job.lines("4 ranks go on at data-parallel size 2 (was 4), the global batch 4 kept")
    _same_sharded_save(nodes.job, sharded_pp_at_dp2, ITERS, STAGES)


def test_the_laid_out_shards_dump_whole_and_the_job_grows_back_from_them_exactly(
        sharded_regrown: Nodes, sharded_at_dp2: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    """After the scale-in, the node back: the dump of step 4 from the shards laid out at DP=2 is Megatron's own DP=2
    save of it, and the job grown back to DP=4 from it ends bit for bit as Megatron's own DP=4 resume of that save."""
    nodes, dumped = sharded_regrown, COMPLETED + 2
    assert nodes.codes == (0, -9, 0), nodes.outputs[0][-5000:]
    assert nodes.job.lines(f"dumped mp_rank_00 of iteration {dumped} in")
    assert nodes.job.lines(f"loading checkpoint from {nodes.job.save} at iteration {dumped}")
    _same_sharded_save(nodes.job, sharded_at_dp2, dumped)
    grown = _megatron_resume(sharded_at_dp2, DP4, tmp_path_factory.mktemp("sharded_at_dp4"), *SHARDED, "--bf16",
                             step=dumped)
    _same_sharded_save(nodes.job, grown, ITERS)


def test_two_nodes_lost_in_turn_the_job_scales_in_twice_and_stays_megatrons_own_resume(
        twice: Nodes, dp4_batch12: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    assert twice.codes[:2] == (0, 0) and twice.codes[2:] == (-9, -9), twice.outputs[0][-5000:]
    assert twice.job.lines("3 ranks go on at data-parallel size 3 (was 4), the global batch 12 kept")
    assert twice.job.lines("2 ranks go on at data-parallel size 2 (was 3), the global batch 12 kept")
    for step in range(1, ITERS + 1):
        assert len(twice.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    at_three = _megatron_resume(dp4_batch12, Launch(3, BATCH12), tmp_path_factory.mktemp("at_dp3"))
    at_two = _megatron_resume(at_three, Launch(2, BATCH12), tmp_path_factory.mktemp("at_dp2"), step=COMPLETED + 2)
    model = "mp_rank_00/model_optim_rng.pt"
    assert differences(twice.job.iteration(ITERS) / model, at_two.iteration(ITERS) / model) == []


def test_a_node_lost_during_the_scale_in_the_survivors_dump_in_bounded_time_and_restart_at_the_size_left(
        lost_in_scale_in: Nodes, dp4_batch12: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A second fault while the survivors rebuild their groups for the scale-in: they do not wait for the lost rank
    in the groups' rendezvous (Megatron's distributed timeout, 10 minutes) but recover's timeout, say so in one
    line, dump step 2 and torchrun restarts the job on the two nodes left, from the dump: bit for bit Megatron's own
    resume at DP=2."""
    nodes = lost_in_scale_in
    assert nodes.codes[:2] == (0, 0) and nodes.codes[2:] == (-9, -9), nodes.outputs[0][-5000:]
    assert nodes.job.lines("3 ranks go on at data-parallel size 3 (was 4), the global batch 12 kept")
    for survivor in (0, 1):
        assert nodes.job.lines(f"[ft_plugins.recover rank {survivor}] ERROR recover: generation 1 cannot recover: "
                               "every rank of the rebuilt job did not come within 10 s; falling back to ttp's dump"), \
            nodes.job.output[-5000:]
    assert nodes.job.lines(f"loading checkpoint from {nodes.job.save} at iteration {COMPLETED}")
    at_two = _megatron_resume(dp4_batch12, Launch(2, BATCH12), tmp_path_factory.mktemp("batch12_at_dp2"))
    model = "mp_rank_00/model_optim_rng.pt"
    assert differences(nodes.job.iteration(COMPLETED) / model, dp4_batch12.iteration(COMPLETED) / model) == []
    assert differences(nodes.job.iteration(ITERS) / model, at_two.iteration(ITERS) / model) == []


def _evaluation_batch(size: int) -> tuple[str, ...]:
    """megatron-core 0.19 checks an evaluation batch against the data-parallel size at start too (the global batch
    unless ``--eval-global-batch-size``), whether the job evaluates or not: its own resume at a size that does not
    divide the batch needs one the size divides, where the release has it."""
    import inspect

    import megatron.training.arguments as arguments  # the release under test

    return ("--eval-global-batch-size", str(size)) if "eval_global_batch_size" in inspect.getsource(arguments) else ()


def test_a_size_that_does_not_divide_the_batch_rounds_it_down_as_megatrons_own_resume_does(
        rounded: tuple[Nodes, Path], evaluated_dp4: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With ``--decrease-batch-size-if-needed``, DP=4 -> 3 with the global batch 4: the line says the batch is now 3;
    every later step reads exactly its 3 samples after the 8 of steps 1 and 2, and the end and the evaluations are
    bit for bit Megatron's own resume at DP=3 with the same switch (without it, the scale-in falls back: the start-up
    line says so). megatron-core 0.19's evaluation batch (the global batch by default) is rounded alike: that
    release's own resume refuses 4 at DP=3, so it is compared with its resume given 3."""
    nodes, samples = rounded
    assert nodes.codes[:3] == (0, 0, 0), nodes.outputs[0][-5000:]
    assert nodes.job.lines("3 ranks go on at data-parallel size 3 (was 4), the global batch now 3 (was 4: Megatron's "
                           "--decrease-batch-size-if-needed)")
    assert nodes.job.lines("the global batch 4 is kept at data-parallel sizes 2, 1 (Megatron's "
                           "--decrease-batch-size-if-needed rounds it down at the others)")
    reads = _reads(samples)
    for step in range(1, ITERS + 1):
        start = (step - 1) * 4 if step <= COMPLETED else COMPLETED * 4 + (step - COMPLETED - 1) * 3
        world = 4 if step <= COMPLETED else 3
        assert sorted(reads[step, world]) == list(range(start, start + world)), step
    evaluation = _evaluation_batch(3)
    if evaluation:
        assert nodes.job.lines("the evaluation batch now 3 (was 4: rounded alike)")
    resumed = _megatron_resume(evaluated_dp4, Launch(3, DP4.args), tmp_path_factory.mktemp("rounded_at_dp3"),
                               ROUNDING, *EVALUATED, *evaluation)
    model = "mp_rank_00/model_optim_rng.pt"
    assert differences(nodes.job.iteration(ITERS) / model, resumed.iteration(ITERS) / model) == []
    evaluated, reference = _validation(nodes.job), _validation(resumed)
    assert len(reference) == 3 and evaluated == reference, (evaluated, reference)


def _controller(calls: list[dict]) -> list[tuple]:
    """What MindIO's stand-in controller did, in order: (action, its arguments)."""
    return [(call["api"].removeprefix("fake_controller_"), *call["args"]) for call in calls
            if call["api"].startswith("fake_controller_")]


def _rebuilt(calls: list[dict]) -> dict[int, str]:
    """The downgrade rebuilds MindIO's stand-in called that answered 0: rank -> its arguments."""
    return {rank: payload for action, rank, payload, answer in
            (entry for entry in _controller(calls) if entry[0] == "zit_downgrade_rebuild") if answer == 0}


def _reported_groups(calls: list[dict], rank: int) -> list[list]:
    """What ``rank`` told MindIO its data-parallel group was (``tft_set_dp_group_info``), in order."""
    return [call["args"] for call in calls if call["rank"] == str(rank) and call["api"] == "tft_set_dp_group_info"]


def test_under_mindio_its_downgrade_scales_in_and_dumps_as_megatrons_own_resume_at_the_smaller_size(
        downgraded: tuple[Nodes, list[dict]], sharded_at_dp2: Job) -> None:
    """The downgrade, then rank 1 lost in step 5: MindIO's dump (after its stop and clean, which hold the groups at
    the size they have: rank 0 of 2, not torchrun's 4) of step 4 is Megatron's own save of it at DP=2, model and
    ``distrib_optim.pt`` whole: the steps after the scale-in were exact, and the dump met no rank that is gone."""
    nodes, calls = downgraded
    assert nodes.codes[0] != 0, nodes.outputs[0][-5000:]
    assert not [call for call in calls if call["api"].startswith("fake_processor_")], calls  # no handler refused
    done = _controller(calls)
    assert done[0] == ("fault", 2, 3), done
    assert [(action, rank, answer) for action, rank, _, answer in done[1:5]] == [
        ("stop", 0, 0), ("stop", 1, 0), ("clean", 0, 0), ("clean", 1, 0)], done
    assert done[5] == ("replacement", 2, "timeout"), done
    assert done[6:8] == [("zit_downgrade_rebuild", rank, repr(([0, 1], [0, 1], '{"scale-in-strategy": "DP"}')), 0)
                         for rank in (0, 1)], done
    # no rollback after a downgrade; the next fault: the dump only
    assert done[8:] == [("fault", 1), ("dump", AFTER_DOWNGRADE), ("save", AFTER_DOWNGRADE), ("rename", AFTER_DOWNGRADE),
                        ("dump", 0, repr(AFTER_DOWNGRADE), 0)], done
    assert [tuple(call["args"]) for call in calls if call["api"] == "fake_before_dump"] == [("stop", None),
                                                                                           ("clean", 0)], calls
    for rank in (0, 1):  # the groups as they stand, reported to MindIO again after the downgrade
        reports = [(call["api"], call["args"]) for call in calls if call["rank"] == str(rank)
                   and call["api"] in ("tft_set_optimizer_replica", "tft_set_dp_group_info")]
        assert reports == [(api, [rank, repr(value)]) for ranks in ([0, 1, 2, 3], [0, 1]) for api, value in (
            ("tft_set_optimizer_replica", [{"rank_list": ranks, "replica_cnt": 2, "replica_shift": 0}]),
            ("tft_set_dp_group_info", ranks))], reports
    registered = {call["args"][0] for call in calls if call["api"] == "tft_register_zit_downgrade_rebuild_handler"}
    assert registered == {"downgrade_rebuild"}, registered
    assert [call["kwargs"].get("enable_zit") for call in calls if call["api"] == "tft_init_processor"] == [True] * 4
    assert nodes.job.lines("elastic: MindIO's downgrade for ranks 2, 3: 2 ranks go on at data-parallel size 2 (was "
                           "4), the global batch 4 kept")
    assert re.search(rf"elastic: MindIO downgrade in [\d.]+ s: every rank stands at step {COMPLETED}, training "
                     rf"continues at step {COMPLETED + 1}", nodes.job.output), nodes.outputs[0][-5000:]
    for step in range(1, AFTER_DOWNGRADE + 1):  # no step lost, none twice
        assert len(nodes.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    assert not nodes.job.lines("loading checkpoint"), "no checkpoint read"
    assert len(nodes.job.lines("laid the distributed optimizer out for data-parallel size 2")) == 2
    _same_sharded_save(nodes.job, sharded_at_dp2, AFTER_DOWNGRADE)  # distrib_optim.pt whole


def test_under_mindio_with_tensor_parallelism_its_downgrade_lays_each_shards_optimizer_out_again(
        downgraded_tp: tuple[Nodes, list[dict]], sharded_tp_at_dp2: Job) -> None:
    """TP=2 x DP=4 -> TP=2 x DP=2 by MindIO's downgrade: it keeps ranks 0 to 3, each tensor-parallel rank's new
    data-parallel group reported to it again; both shards' final saves, ``distrib_optim.pt`` whole, are Megatron's
    own resume at TP=2 x DP=2."""
    nodes, calls = downgraded_tp
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert not [call for call in calls if call["api"].startswith("fake_processor_")], calls  # no handler refused
    groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}  # each tensor-parallel rank's data-parallel group at DP=2
    assert _rebuilt(calls) == {rank: repr((group, [0, 1, 2, 3], '{"scale-in-strategy": "DP"}'))
                               for rank, group in groups.items()}, _rebuilt(calls)
    for rank, group in groups.items():
        reported = _reported_groups(calls, rank)
        assert reported == [[rank, repr([rank % 2 + 2 * index for index in range(4)])], [rank, repr(group)]], reported
    assert nodes.job.lines("elastic: MindIO's downgrade for ranks 4, 5, 6, 7: 4 ranks go on at data-parallel size 2 "
                           "(was 4), the global batch 4 kept")
    for step in range(1, ITERS + 1):  # no step lost, none twice
        assert len(nodes.job.lines(f"iteration        {step}/       {ITERS}")) == 1, step
    assert not nodes.job.lines("loading checkpoint"), "no checkpoint read"
    assert len(nodes.job.lines("laid the distributed optimizer out for data-parallel size 2")) == 4
    _same_sharded_save(nodes.job, sharded_tp_at_dp2, ITERS, SHARDS)


def test_under_mindio_with_pipeline_stages_its_downgrade_lays_each_stages_optimizer_out_again(
        downgraded_pp: tuple[Nodes, list[dict]], sharded_pp_at_dp2: Job) -> None:
    """PP=2 x DP=4 -> PP=2 x DP=2 by MindIO's downgrade: it keeps ranks 0, 1, 4 and 5 (numbered 0 to 3 after it) and
    ends the healthy stage 0 of the dropped replicas; each rank's new data-parallel group goes to MindIO again in
    MindIO's numbering; both stages' final saves, ``distrib_optim.pt`` whole, are Megatron's own resume at
    PP=2 x DP=2."""
    nodes, calls = downgraded_pp
    assert nodes.codes[0] == 0, nodes.outputs[0][-5000:]
    assert not [call for call in calls if call["api"].startswith("fake_processor_")], calls  # no handler refused
    groups = {0: [0, 1], 1: [0, 1], 4: [4, 5], 5: [4, 5]}  # each stage's data-parallel group at DP=2, MindIO's ranks
    assert _rebuilt(calls) == {rank: repr((group, [0, 1, 4, 5], '{"scale-in-strategy": "DP"}'))
                               for rank, group in groups.items()}, _rebuilt(calls)
    assert ("fault_nodes_exit", repr([2, 3])) in _controller(calls), _controller(calls)
    for rank, group in groups.items():
        reported = _reported_groups(calls, rank)
        assert reported == [[rank, repr([rank // 4 * 4 + index for index in range(4)])], [rank, repr(group)]], \
            reported
    assert nodes.job.lines("elastic: MindIO's downgrade for ranks 2, 3, 6, 7: 4 ranks go on at data-parallel size 2 "
                           "(was 4), the global batch 4 kept")
    assert not nodes.job.lines("loading checkpoint"), "no checkpoint read"
    _same_sharded_save(nodes.job, sharded_pp_at_dp2, ITERS, STAGES)


def test_negative_control_under_mindio_without_elastic_the_same_loss_ends_the_job_in_the_dump(
        not_downgraded: tuple[Nodes, list[dict]], sharded_reference: Job) -> None:
    nodes, calls = not_downgraded
    assert nodes.codes[0] != 0
    done = _controller(calls)
    # one of the lost node's ranks seen first; the other, asked to stop, does not answer: the dump
    assert done[0] in (("fault", 2), ("fault", 3)) and ("dump", COMPLETED) in done, done
    assert not [action for action, *_ in done if action.startswith("zit_")], done
    assert not nodes.job.lines(f"iteration        {COMPLETED + 1}/       {ITERS}"), "step 3 was never trained"
    _same_sharded_save(nodes.job, sharded_reference, COMPLETED)
