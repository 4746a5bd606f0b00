"""The Trainer tests' shared reference: one uninterrupted 12-step run saving every 2 steps, all features
on with the vendor fakes (taskd, mstx), for the whole session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.register_assert_rewrite("hf_runs")

from hf_runs import STEPS, Job, run_trainer  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("hf-reference")
    job = run_trainer(workdir, workdir / "out", "--steps", str(STEPS), "--save-steps", "2", fakes=True,
                      FT_PLUGINS="taskd,mstx,resume", FT_FAKE_RECORD=str(workdir / "calls.jsonl"))
    assert job.returncode == 0, job.output[-3000:]
    return job
