"""The dying-gasp tests' shared references: uninterrupted runs saving every step (2 ranks; TP=2 x DP=2 on 4), for
the whole session.
The helper modules beside this file are importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.register_assert_rewrite("ttp_runs")

from ttp_runs import DP4, ITERS, SHARDS, TP, Job, run_job  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The uninterrupted run, without ft_plugins, saving every step."""
    workdir = tmp_path_factory.mktemp("reference")
    job = run_job(workdir, "--save-interval", "1", FT_PLUGINS="none")
    assert job.returncode == 0, job.output[-3000:]
    assert job.tracker() == str(ITERS)
    return job


@pytest.fixture(scope="session")
def dp4_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The uninterrupted DP=4 run (4 ranks), without ft_plugins, saving every step: the in-place recoveries' yardstick."""
    return DP4.reference(tmp_path_factory.mktemp("dp4_reference"))


@pytest.fixture(scope="session")
def tp_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The uninterrupted TP=2 x DP=2 run on 4 ranks, without ft_plugins, saving every step."""
    job = TP.reference(tmp_path_factory.mktemp("tp_reference"))
    assert sorted(path.name for path in job.iteration(ITERS).iterdir()) == list(SHARDS)
    return job
