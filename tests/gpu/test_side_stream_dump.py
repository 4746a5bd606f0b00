"""On a CUDA device: ``ttp``'s dump is not held up by a kernel stuck on the training stream.

A collective waiting for a lost peer (NCCL, HCCL) is, to the device, a kernel that does not end; everything queued
after it on the stream waits too, a plain copy of the state to the host (``torch.save``'s) among them. Here a kernel
of ``STUCK`` seconds queued on the stream as step 4 begins (``FT_PLUGINS_INJECT_FAULT=...,at=device``, CUDA's
``torch.cuda._sleep``) stands in for it, and SIGTERM starts the dump of step 3 behind it. Megatron's ``pretrain()``
of the example, one GPU, NCCL, bf16, dropout on, deterministic mode:

- the dump waits for the device to finish step 3's work (an event recorded at the step boundary), copies on a stream
  of its own and commits while the stuck kernel still runs, within ``AFTER_ABORT`` seconds of the abort of the
  communicators returning (the abort itself took 58 s and 98 s on an H200 while the kernel ran: NCCL's time, timed
  apart); its ``model_optim_rng.pt`` is bit for bit Megatron's own save of step 3 (model, optimizer with its fp32
  main parameters, scheduler, RNG, counters);
- negative control, the side stream off (``FT_PLUGINS_TTP_DEVICE_WAIT=0``): the dump's copies queue behind the
  stuck kernel, and nothing is dumped within ``MARGIN`` seconds more than the side stream's dump took.

Not in the suite CI runs (CI has no GPU: ``tests/conftest.py`` leaves this folder out unless ``GPU_CHECKS=1``). Run
it where a GPU is, from the installed wheel with megatron-core 0.17.1: ``GPU_CHECKS=1 python -m pytest tests/gpu``;
without a CUDA device it is skipped with that reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: the stuck kernel is CUDA's (torch.cuda._sleep)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_megatron"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_runs import AFTER_ABORT, MARGIN, STUCK, aborted_seconds, launch_job, negative_watch, watch_job  # noqa: E402
from ttp_runs import differences  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt" / "pretrain_gpt.py"
STEP = 3  # the last completed step
FAULT = f"rank=0,step={STEP},kind=term,at=device,seconds={STUCK}"
GPU_ARGS = ("--bf16", "--distributed-backend", "nccl", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
            "--deterministic-mode", "--hidden-size", "256", "--num-attention-heads", "8", "--num-layers", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024")
DUMPED = f"rank 0 dumped mp_rank_00 of iteration {STEP}"


def _launch(save: Path, port: int, *args: str, **env: str) -> subprocess.Popen[str]:
    return launch_job(port, str(EXAMPLE), *GPU_ARGS, "--save", str(save), *args, NCCL_ALGO="Ring",
                      CUBLAS_WORKSPACE_CONFIG=":4096:8", **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("gpu")
    reference = _launch(root / "reference", 29517, "--train-iters", "8", "--save-interval", str(STEP),
                        "--exit-interval", str(STEP), FT_PLUGINS="none")  # the same schedule, ended after STEP
    output = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0, output[-4000:]
    side, side_seen = watch_job(_launch(root / "side", 29518, "--train-iters", "8", "--save-interval", "100",
                                     FT_PLUGINS="ttp", FT_PLUGINS_INJECT_FAULT=FAULT), DUMPED,
                             after_fault=STUCK - MARGIN)
    watch = negative_watch(side_seen)
    plain, plain_seen = watch_job(_launch(root / "plain", 29519, "--train-iters", "8", "--save-interval", "100",
                                       FT_PLUGINS="ttp", FT_PLUGINS_INJECT_FAULT=FAULT, FT_PLUGINS_TTP_DEVICE_WAIT="0"),
                               DUMPED, after_fault=watch)
    yield {"root": root, "reference": output, "side": side, "side_seen": side_seen, "plain": plain,
           "plain_seen": plain_seen, "watch": watch}


def test_the_dump_behind_a_stuck_kernel_commits_within_seconds_of_the_abort(runs: dict) -> None:
    side = runs["side"]
    assert "firing injected fault" in side and "kind=term,at=device" in side, side[-4000:]
    assert runs["side_seen"] is not None and runs["side_seen"] < STUCK - MARGIN, side[-4000:]  # the kernel still ran
    aborted = aborted_seconds(side)
    assert aborted, side[-4000:]
    assert runs["side_seen"] - sum(aborted) < AFTER_ABORT, (runs["side_seen"], aborted)
    dumped = next(line for line in side.splitlines() if DUMPED in line)
    assert "committed" in dumped, dumped
    steps = [line.strip() for line in side.splitlines() if "aborted this rank" in line or "the device ran" in line]
    print(f"dumped {runs['side_seen']:.2f} s after the stuck kernel was queued: {dumped.strip()}", *steps, sep="\n")


def test_the_dump_is_bit_for_bit_megatrons_own_save_of_the_step(runs: dict) -> None:
    shard = f"iter_{STEP:07d}/mp_rank_00/model_optim_rng.pt"
    root = runs["root"]
    assert (root / "side" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEP)
    assert differences(root / "side" / shard, root / "reference" / shard) == []


def test_without_the_side_stream_the_dump_waits_behind_the_stuck_kernel(runs: dict) -> None:
    plain = runs["plain"]
    assert "firing injected fault" in plain, plain[-4000:]
    assert runs["plain_seen"] is None and DUMPED not in plain, (runs["watch"], plain[-4000:])
    assert not (runs["root"] / "plain" / "latest_checkpointed_iteration.txt").exists()
