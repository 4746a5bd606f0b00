"""On a CUDA device: ``ttp``'s dump is not held up by a kernel stuck on the training stream.

A collective waiting for a lost peer (NCCL, HCCL) is, to the device, a kernel that does not end; everything queued
after it on the stream waits too, a plain copy of the state to the host (``torch.save``'s) among them. Here a kernel
of ``STUCK`` seconds queued on the stream as step 4 begins (``FT_PLUGINS_INJECT_FAULT=...,at=device``, CUDA's
``torch.cuda._sleep``) stands in for it, and SIGTERM starts the dump of step 3 behind it. Megatron's ``pretrain()``
of the example, one GPU, NCCL, bf16, dropout on, deterministic mode:

- the dump waits for the device to finish step 3's work (an event recorded at the step boundary), copies on a stream
  of its own and commits while the stuck kernel still runs, within ``PLAIN_WATCH`` seconds of the fault (the abort
  of the communicators before it took 58 s and 98 s of that on an H200); its ``model_optim_rng.pt`` is bit for
  bit Megatron's own save of step 3 (model, optimizer with its fp32 main parameters, scheduler, RNG, counters);
- negative control, the side stream off (``FT_PLUGINS_TTP_DEVICE_WAIT=0``): the dump's copies queue behind the
  stuck kernel, and nothing is dumped while it runs.

Not in the suite CI runs (CI has no GPU: ``tests/conftest.py`` leaves this folder out unless ``GPU_CHECKS=1``). Run
it where a GPU is, from the installed wheel with megatron-core 0.17.1: ``GPU_CHECKS=1 python -m pytest tests/gpu``;
without a CUDA device it is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: the stuck kernel is CUDA's (torch.cuda._sleep)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_megatron"))
from ttp_runs import differences  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt" / "pretrain_gpt.py"
STEP, STUCK = 3, 240  # the last completed step; seconds the stuck kernel runs
FAULT = f"rank=0,step={STEP},kind=term,at=device,seconds={STUCK}"
GPU_ARGS = ("--bf16", "--distributed-backend", "nccl", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
            "--deterministic-mode", "--hidden-size", "256", "--num-attention-heads", "8", "--num-layers", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024")
DUMPED = f"rank 0 dumped mp_rank_00 of iteration {STEP}"
PLAIN_WATCH = 100  # seconds the negative control is watched after its fault: longer than the side stream's dump took


def _launch(save: Path, port: int, *args: str, **env: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
               str(EXAMPLE), *GPU_ARGS, "--save", str(save), *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    return subprocess.Popen(command, env={**clean, "PYTHONUNBUFFERED": "1", "NCCL_ALGO": "Ring",
                                          "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _watch(process: subprocess.Popen[str], until: str, after_fault: float) -> tuple[str, float | None]:
    """The job's output until ``until`` shows (and the seconds from the fault to it), or until ``after_fault``
    seconds passed after the fault fired; then the job is ended, stuck kernel and all."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    fired = seen_after = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        waited = after_fault - (time.monotonic() - fired) if fired is not None else deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(waited, 0.01))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if fired is None and "firing injected fault" in line:
            fired = time.monotonic()
        if until in line:
            seen_after = time.monotonic() - (fired if fired is not None else time.monotonic())
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    with contextlib.suppress(queue.Empty):  # what was printed before the end
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
    return "".join(seen), seen_after


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("gpu")
    reference = _launch(root / "reference", 29517, "--train-iters", "8", "--save-interval", str(STEP),
                        "--exit-interval", str(STEP), FT_PLUGINS="none")  # the same schedule, ended after STEP
    output = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0, output[-4000:]
    side, side_seen = _watch(_launch(root / "side", 29518, "--train-iters", "8", "--save-interval", "100",
                                     FT_PLUGINS="ttp", FT_PLUGINS_INJECT_FAULT=FAULT), DUMPED, after_fault=STUCK / 2)
    plain, plain_seen = _watch(_launch(root / "plain", 29519, "--train-iters", "8", "--save-interval", "100",
                                       FT_PLUGINS="ttp", FT_PLUGINS_INJECT_FAULT=FAULT, FT_PLUGINS_TTP_DEVICE_WAIT="0"),
                               DUMPED, after_fault=PLAIN_WATCH)
    yield {"root": root, "reference": output, "side": side, "side_seen": side_seen, "plain": plain,
           "plain_seen": plain_seen}


def test_the_dump_behind_a_stuck_kernel_commits_within_seconds(runs: dict) -> None:
    side = runs["side"]
    assert "firing injected fault" in side and "kind=term,at=device" in side, side[-4000:]
    assert runs["side_seen"] is not None and runs["side_seen"] < PLAIN_WATCH, side[-4000:]
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
    assert runs["plain_seen"] is None and DUMPED not in plain, plain[-4000:]
    assert not (runs["root"] / "plain" / "latest_checkpointed_iteration.txt").exists()
