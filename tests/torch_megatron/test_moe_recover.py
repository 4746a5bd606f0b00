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
"""

from __future__ import annotations

import pytest

from ttp_runs import ITERS, Job, Launch, run_supervised, same_as_reference

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
