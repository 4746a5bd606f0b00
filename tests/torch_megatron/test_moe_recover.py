"""``recover`` with a mixture of experts and expert parallelism (real 4-rank ``ft-plugins run -- torchrun``
``pretrain()``, CPU/gloo): 2 experts, expert parallelism 2, DP=4, Megatron's local MoE layers with the allgather
token dispatcher (the alltoall dispatcher cannot run on gloo/CPU: Megatron hands ``all_to_all_single`` its split
sizes as tensors, which gloo's binding refuses).

Ranks 0 and 2 hold expert 0, ranks 1 and 3 expert 1, while all four are data-parallel replicas of the dense layers.
Rank 1 lost: its state must come from rank 3, the one survivor holding the same experts; before ranks were grouped
by their experts too, rank 0 sent its own (expert 0's) and the run ended with exit 0 and wrong weights. The final
save's expert shards (``mp_rank_00_000``, ``mp_rank_00_001``: the latter written by the replacement) are the
uninterrupted run's bit for bit, optimizer included. With Megatron's distributed optimizer the experts' optimizer
shards are not handed over yet: refused at the start (``tests/torch_megatron/test_recover.py``).

``ttp``'s dump with the distributed optimizer (every rank SIGTERMed, as a preemption does): Megatron's chained
optimizer saves the experts' part of ``distrib_optim.pt`` on the first rank of each expert group, so rank 1 writes
``mp_rank_00_001``'s file with the dense part empty. The dump wrote only the dense group's first rank's, so
``mp_rank_00_001`` had no writer and the dump was never committed.
"""

from __future__ import annotations

import pytest

from support import assert_bit_identical
from ttp_runs import ITERS, Job, Launch, run_supervised, same_as_reference

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

MOE = Launch(4, ("--num-experts", "2", "--expert-model-parallel-size", "2", "--moe-router-topk", "1",
                 "--moe-router-pre-softmax", "--moe-token-dispatcher-type", "allgather",
                 "--micro-batch-size", "1", "--global-batch-size", "4"))
FAR = ("--save-interval", "100")
EXPERT_SHARDS = ("mp_rank_00_000", "mp_rank_00_001")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return MOE.reference(tmp_path_factory.mktemp("moe_reference"), *FAR)  # the final save only


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("moe_recovered"), MOE, *FAR, FT_PLUGINS="ttp,recover",
                          FT_PLUGINS_INJECT_FAULT="rank=1,step=2,kind=kill")


def test_the_lost_ranks_experts_come_from_the_survivor_holding_the_same_experts(recovered: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-5000:]
    sent = recovered.lines("sent the state of step 2 (")
    assert len(sent) == 1 and "rank 3 sent" in sent[0] and sent[0].endswith("to rank 1"), sent
    assert recovered.lines("recover: rank 1 joined generation 1")


def test_the_final_save_of_each_expert_shard_is_the_uninterrupted_runs(recovered: Job, reference: Job) -> None:
    assert sorted(path.name for path in recovered.iteration(ITERS).iterdir()) == list(EXPERT_SHARDS)
    for shard in EXPERT_SHARDS:
        assert same_as_reference(recovered, reference, ITERS, shard=shard) == [], shard


DISTRIBUTED = Launch(MOE.nproc, (*MOE.args, "--use-distributed-optimizer"))
PREEMPTED = 2  # every rank SIGTERMed in the step after 2 completed steps


@pytest.fixture(scope="module")
def distributed_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DISTRIBUTED.reference(tmp_path_factory.mktemp("moe_distributed_reference"))


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return DISTRIBUTED.run(tmp_path_factory.mktemp("moe_preempted"), *FAR, FT_PLUGINS="ttp,resume",
                           FT_PLUGINS_TTP_REPLICAS="1", FT_PLUGINS_INJECT_FAULT=DISTRIBUTED.preemption(PREEMPTED))


def test_the_dump_of_each_expert_shard_is_committed_with_its_optimizer_state_bit_for_bit(
        preempted: Job, distributed_reference: Job) -> None:
    assert preempted.returncode != 0 and preempted.tracker() == str(PREEMPTED), preempted.output[-4000:]
    for rank, shard in ((0, EXPERT_SHARDS[0]), (1, EXPERT_SHARDS[1])):  # each expert group's first rank
        assert preempted.lines(f"rank {rank} dumped {shard} of iteration {PREEMPTED}"), preempted.output[-4000:]
    for shard in EXPERT_SHARDS:
        assert same_as_reference(preempted, distributed_reference, PREEMPTED, shard=shard) == [], shard
        assert_bit_identical(distributed_reference.iteration(PREEMPTED) / shard / "distrib_optim.pt",
                             preempted.iteration(PREEMPTED) / shard / "distrib_optim.pt", parts=None)
