"""The Trainer dump replacing a ``checkpoint-K`` that is there already, on real 2-rank torchrun runs (gloo, CPU) with
``resume`` off, so that the Trainer's own save of K is complete but never committed and the dump replaces it. The
dump's writer is SIGKILLed at the instant between the replacement's first step and its next
(``fixtures/mid_replace``): the old code had removed the old ``checkpoint-K`` there and left only
``tmp-checkpoint-K``, which nothing loads. Now a complete ``checkpoint-K`` stands at every instant where the file
system swaps two folders in one rename (``swap``), and where it cannot (``aside``, as on NFS) the next start puts
the dump in place; either way transformers' own ``get_last_checkpoint`` finds it and the Trainer resumes from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.trainer_utils import get_last_checkpoint

from hf_runs import STEPS, Job, run_trainer

from ft_plugins.checkpoint import verify
from ft_plugins.checkpoint.manifest import MANIFEST

ARGS = ("--save-steps", "4")
TTP = {"FT_PLUGINS": "ttp"}  # no resume: the Trainer's checkpoint-4 is complete, uncommitted, replaced by the dump
FAULT = "rank=1,step=4,kind=kill"  # rank 1 dies in step 5, after the save of checkpoint-4: rank 0 dumps step 4
MID_REPLACE = Path(__file__).resolve().parent / "fixtures" / "mid_replace"


def _trained_steps(job: Job) -> int:
    """The optimizer steps a run made: the Trainer prints one ``{'loss': ...}`` per step (``logging_steps=1``)."""
    return len(job.lines("{'loss': "))


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "aside"])
def test_a_crash_inside_the_dump_s_replacement_leaves_a_checkpoint_the_trainer_resumes_from(
        tmp_path: Path, swap: bool) -> None:
    out = tmp_path / "out"
    crash = {"PYTHONPATH": str(MID_REPLACE), "FT_FAKE_KILL_MID_REPLACE": "1",
             **({} if swap else {"FT_FAKE_NO_EXCHANGE": "1"})}
    crashed = run_trainer(tmp_path, out, *ARGS, FT_PLUGINS_INJECT_FAULT=FAULT, **crash, **TTP)
    assert crashed.returncode != 0 and len(crashed.lines("mid_replace: SIGKILL before")) == 1, crashed.output[-4000:]
    assert not crashed.lines("dumped")
    checkpoint, staging = crashed.checkpoint(4), out / "tmp-checkpoint-4"
    if swap:  # at once, before any start: checkpoint-4 is the dump, whole and committed; the old one left beside
        assert get_last_checkpoint(str(out)) == str(checkpoint)
        assert (checkpoint / MANIFEST).exists() and verify(checkpoint).intact
        assert staging.is_dir() and not (staging / MANIFEST).exists()
    else:  # the old one aside, the committed dump staged: the next start puts the dump in place
        assert (staging / MANIFEST).exists() and (out / "tmp-checkpoint-4.replaced").is_dir()

    resumed = run_trainer(tmp_path, out, *ARGS, **TTP)
    assert resumed.returncode == 0, resumed.output[-4000:]
    if not swap:
        assert len(resumed.lines(f"ttp: {checkpoint}: the committed dump in {staging} put in place")) == 1
    leftover = staging if swap else out / "tmp-checkpoint-4.replaced"
    assert len(resumed.lines(f"ttp: removed {leftover}")) == 1, resumed.output[-4000:]
    assert _trained_steps(resumed) == STEPS - 4, resumed.output[-4000:]  # resumed from checkpoint-4
    assert sorted(path.name for path in out.iterdir() if "checkpoint" in path.name) == \
        ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
