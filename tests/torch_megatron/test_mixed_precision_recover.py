"""In-place recovery of 16-bit training (``--bf16``, ``--fp16``) on real 4-rank torchrun runs of Megatron's
``pretrain()`` (CPU, gloo, DP=4), launched as ``ft-plugins run -- torchrun ...``, each against the uninterrupted
run of the same precision.

Megatron's float16 optimizer trains fp32 main parameters (``fp32_from_fp16_params`` in the ``optimizer`` entry of
``model_optim_rng.pt``) beside the 16-bit model, and with ``--fp16`` a dynamic loss scale. A replacement must
receive them exactly: main parameters rounded to the model's dtype (or a loss scale that starts over) make the
replacement's updates, then through its gradients in the all-reduce every replica's, drift apart silently.

- bf16, ``recover``: rank 0 killed mid-run; its replacement writes the final save, so its own main parameters and
  Adam moments are what is compared.
- fp16, MindIO's recovery handlers (its stand-in's controller lives in rank 0): rank 1 killed mid-run; a main
  parameter or loss scale that arrived inexactly reaches rank 0's final save through the gradients.
"""

from __future__ import annotations

import re

import pytest

from support import saved_tensors
from ttp_runs import (DP4, ITERS, Job, Launch, assert_no_step_logged_twice, run_supervised, run_with_mindio,
                      same_as_reference)

pytestmark = pytest.mark.newest_megatron  # on megatron-core 0.19 only: the newest lane's suite

LOST = 3  # the rank dies as the step after 3 of 6 completed steps begins
BF16 = Launch(DP4.nproc, (*DP4.args, "--bf16"))
INITIAL_SCALE = 4096
# a dynamic loss scale that moves within the run (doubled after every 2 steps without overflow)
FP16 = Launch(DP4.nproc, (*DP4.args, "--fp16", "--initial-loss-scale", str(INITIAL_SCALE), "--loss-scale-window", "2"))
RECOVER = {"FT_PLUGINS": "ttp,recover"}
MODEL_FILE = "mp_rank_00/model_optim_rng.pt"


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return BF16.reference(tmp_path_factory.mktemp("bf16_reference"))


@pytest.fixture(scope="module")
def fp16_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return FP16.reference(tmp_path_factory.mktemp("fp16_reference"))


@pytest.fixture(scope="module")
def bf16_recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_supervised(tmp_path_factory.mktemp("bf16_recovered"), BF16, "--save-interval", "100", **RECOVER,
                          FT_PLUGINS_INJECT_FAULT=f"rank=0,step={LOST},kind=kill")


@pytest.fixture(scope="module")
def fp16_repaired(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict]]:
    """Repaired through MindIO's handlers (its stand-in on the path)."""
    return run_with_mindio(tmp_path_factory.mktemp("fp16_mindio_repaired"), FP16, "--save-interval", "100",
                           **RECOVER, FT_PLUGINS_INJECT_FAULT=f"rank=1,step={LOST},kind=kill")


def test_bf16_rank_0_is_replaced_in_place_the_survivors_keep_their_processes(bf16_recovered: Job) -> None:
    job = bf16_recovered
    assert job.returncode == 0, job.output[-5000:]
    assert len(job.lines("firing injected fault")) == 1
    assert re.search(r"rank 0 exited with code -9; replacement pid \d+", job.output), job.output[-5000:]
    assert job.lines(f"every rank stands at step {LOST}, training continues at step {LOST + 1}")
    for survivor in (1, 2, 3):
        assert len(job.lines(f"recover: rank {survivor} (pid")) == 1, "caught once, in its own process"
    trained_once(job)


def test_bf16_the_replacements_final_save_is_the_uninterrupted_runs_main_parameters_and_moments_included(
        bf16_recovered: Job, bf16_reference: Job) -> None:
    assert bf16_recovered.returncode == 0, bf16_recovered.output[-5000:]
    assert same_as_reference(bf16_recovered, bf16_reference, ITERS) == []  # model, optimizer, scheduler, RNG, counters
    holds_fp32_main_parameters(bf16_reference, "torch.bfloat16")


def test_fp16_rank_1_repaired_by_mindios_handlers_the_final_save_is_the_uninterrupted_runs_loss_scale_included(
        fp16_repaired: tuple[Job, list[dict]], fp16_reference: Job) -> None:
    job, calls = fp16_repaired
    controller = [(call["api"], call["args"]) for call in calls if call["api"].startswith("fake_controller")]
    assert job.returncode == 0, f"{job.output[-5000:]}\nthe MindIO stand-in's controller: {controller}"
    assert sorted(c["args"][0] for c in calls if c["api"] == "fake_controller_repair") == [0, 1], "rank 0 to rank 1"
    assert not [c for c in calls if c["api"].startswith("fake_processor_")], "no handler refused"
    assert job.lines(f"every rank stands at step {LOST}, training continues at step {LOST + 1}")
    assert_no_step_logged_twice(job)
    assert not job.lines("loading checkpoint") and not job.lines("dumped")
    assert same_as_reference(job, fp16_reference, ITERS) == []
    holds_fp32_main_parameters(fp16_reference, "torch.float16")
    scale = saved_tensors(fp16_reference.iteration(ITERS) / MODEL_FILE)["/optimizer/grad_scaler/scale"]
    assert float(scale) > INITIAL_SCALE, "the loss scale moved during the run: its state is compared"


def trained_once(job: Job) -> None:
    """Every step logged once, nothing read from disk, no dump: the recovery happened in place."""
    assert [len(job.lines(f"iteration        {i}/       {ITERS}")) for i in range(1, ITERS + 1)] == [1] * ITERS
    assert not job.lines("loading checkpoint") and not job.lines("dumped")


def holds_fp32_main_parameters(job: Job, model_dtype: str) -> None:
    """The final save compared holds a 16-bit model, its fp32 main parameters and Adam's moments."""
    compared = saved_tensors(job.iteration(ITERS) / MODEL_FILE)
    masters = {str(tensor.dtype) for name, tensor in compared.items() if name.startswith("/optimizer/fp32_from_fp16")}
    weights = {str(tensor.dtype) for name, tensor in compared.items()
               if name.startswith("/model/") and tensor.is_floating_point()}
    assert (masters, weights) == ({"torch.float32"}, {model_dtype})
    assert [name for name in compared if name.endswith(("/exp_avg", "/exp_avg_sq"))]
