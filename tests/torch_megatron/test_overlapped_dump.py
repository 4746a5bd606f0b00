"""``ttp``'s dump with Megatron's distributed optimizer and ``--overlap-param-gather`` (real 2-rank ``pretrain()``,
bf16, gloo, buckets small enough that the model spans several): every rank SIGTERMed inside its optimizer update,
as a preemption can. The dump waits for the update to end and writes that step, K. Each rank's update wrote its
own shard of the bf16 weights; the other shards reach it only through Megatron's parameter all-gather, which with
the overlap runs bucket by bucket inside the next step's forward, which a frozen rank never starts. A dump that
wrote the weights as they stood held step K - 1's for every shard not its own beside step K's optimizer state; the dump gathers every shard's weights in the optimizer's gloo group first, so the model file
and ``distrib_optim.pt`` are Megatron's own save of step K bit for bit, and a plain ``--load`` ends as the
uninterrupted run."""

from __future__ import annotations

import pytest

from support import assert_bit_identical
from ttp_runs import ITERS, Job, Launch, committed_dump, resumed_to_the_end, same_as_reference

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

OVERLAPPED = Launch(2, ("--bf16", "--micro-batch-size", "1", "--global-batch-size", "2", "--use-distributed-optimizer",
                        "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"))
FAR = ("--save-interval", "100")
TTP = {"FT_PLUGINS": "ttp,resume", "FT_PLUGINS_TTP_REPLICAS": "1"}
STEP = 3  # every rank SIGTERMed inside the update of step 3: the dump is of step 3
OPTIMIZER = "mp_rank_00/distrib_optim.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return OVERLAPPED.reference(tmp_path_factory.mktemp("overlapped_reference"))


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return OVERLAPPED.run(tmp_path_factory.mktemp("overlapped_preempted"), *FAR, **TTP,
                          FT_PLUGINS_INJECT_FAULT=OVERLAPPED.preemption(STEP - 1, at="update"))


def test_the_dump_holds_one_step_weights_and_optimizer_state_alike(preempted: Job, reference: Job) -> None:
    committed_dump(preempted, STEP)
    assert same_as_reference(preempted, reference, STEP) == []
    assert_bit_identical(reference.iteration(STEP) / OPTIMIZER, preempted.iteration(STEP) / OPTIMIZER, parts=None)


def test_plain_load_of_the_dump_ends_as_the_uninterrupted_run(preempted: Job, reference: Job) -> None:
    resumed = OVERLAPPED.resume(preempted, *FAR, **TTP)
    resumed_to_the_end(resumed, reference, STEP)
    assert_bit_identical(reference.iteration(ITERS) / OPTIMIZER, resumed.iteration(ITERS) / OPTIMIZER, parts=None)
