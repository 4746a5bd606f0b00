"""On a CUDA device: the Hugging Face Trainer's ``ttp`` dump is not held up by a kernel stuck on the training stream.

The Trainer's twin of ``test_side_stream_dump.py``: the Trainer example (``examples/hf_trainer/train.py --gpu``: GPT-2
from a config, one GPU, dropout on, transformers' full determinism), a kernel of ``STUCK`` seconds queued on the
stream as step 4's first micro-batch starts (``FT_PLUGINS_INJECT_FAULT=...,at=device``), and SIGTERM starting the
dump of step 3 behind it:

- the dump waits for the device to finish step 3's work (the mark at step 4's start), copies on a stream of its own
  and commits ``checkpoint-3`` while the kernel still runs, within ``AFTER_ABORT`` seconds of the abort of any
  communicator returning; its model and optimizer are bit for bit the Trainer's own save of step 3;
- negative control, the side stream off (``FT_PLUGINS_TTP_DEVICE_WAIT=0``): nothing is dumped within ``MARGIN``
  seconds more than the side stream's dump took.

Not run yet: written for the next machine with a GPU (``GPU_CHECKS=1 python -m pytest tests/gpu``, from the installed
wheel); without a CUDA device it is skipped with that reason.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_runs import AFTER_ABORT, MARGIN, STUCK, aborted_seconds, launch_job, negative_watch, watch_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"
STEP = 3  # the last completed step
FAULT = f"rank=0,step={STEP},kind=term,at=device,seconds={STUCK}"
DUMPED = f"checkpoint-{STEP} in "  # ttp's line: "rank 0 dumped .../checkpoint-3 in N ms; committed"


def _launch(out: Path, port: int, *args: str, **env: str) -> subprocess.Popen[str]:
    return launch_job(port, str(EXAMPLE), str(out), "--gpu", "--steps", "8", *args, FT_EXAMPLE_IMPORT="1", **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("gpu_trainer")
    reference = _launch(root / "reference", 29527, "--save-steps", str(STEP), FT_PLUGINS="none")
    output = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0, output[-4000:]
    side, side_seen = watch_job(_launch(root / "side", 29528, "--save-steps", "100", FT_PLUGINS="ttp",
                                        FT_PLUGINS_INJECT_FAULT=FAULT), DUMPED, after_fault=STUCK - MARGIN)
    watch = negative_watch(side_seen)
    plain, plain_seen = watch_job(_launch(root / "plain", 29529, "--save-steps", "100", FT_PLUGINS="ttp",
                                          FT_PLUGINS_INJECT_FAULT=FAULT, FT_PLUGINS_TTP_DEVICE_WAIT="0"),
                                  DUMPED, after_fault=watch)
    yield {"root": root, "side": side, "side_seen": side_seen, "plain": plain, "plain_seen": plain_seen,
           "watch": watch}


def test_the_trainers_dump_behind_a_stuck_kernel_commits_within_seconds_of_the_abort(runs: dict) -> None:
    side = runs["side"]
    assert "firing injected fault" in side and "kind=term,at=device" in side, side[-4000:]
    assert runs["side_seen"] is not None and runs["side_seen"] < STUCK - MARGIN, side[-4000:]  # the kernel still ran
    aborted = aborted_seconds(side)
    assert runs["side_seen"] - sum(aborted) < AFTER_ABORT, (runs["side_seen"], aborted)
    dumped = next(line for line in side.splitlines() if DUMPED in line)
    assert "committed" in dumped, dumped
    print(f"dumped {runs['side_seen']:.2f} s after the stuck kernel was queued: {dumped.strip()}")


def test_the_trainers_dump_is_bit_for_bit_its_own_save_of_the_step(runs: dict) -> None:
    from safetensors.torch import load_file

    dump, save = (runs["root"] / name / f"checkpoint-{STEP}" for name in ("side", "reference"))
    model, reference_model = load_file(dump / "model.safetensors"), load_file(save / "model.safetensors")
    assert sorted(model) == sorted(reference_model)
    assert [name for name in model if not torch.equal(model[name], reference_model[name])] == []
    optimizer, reference_optimizer = (torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
                                      for path in (dump, save))
    assert optimizer["state"].keys() == reference_optimizer["state"].keys()
    assert [f"{index}.{key}" for index, state in optimizer["state"].items() for key, value in state.items()
            if not torch.equal(value, reference_optimizer["state"][index][key])] == []


def test_without_the_side_stream_the_trainers_dump_waits_behind_the_stuck_kernel(runs: dict) -> None:
    plain = runs["plain"]
    assert "firing injected fault" in plain, plain[-4000:]
    assert runs["plain_seen"] is None and DUMPED not in plain, (runs["watch"], plain[-4000:])
    assert not (runs["root"] / "plain" / f"checkpoint-{STEP}").exists()
