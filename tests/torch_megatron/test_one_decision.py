"""One decision for the launcher and the workers: with ``FT_PLUGINS=all`` on a node where MindIO is installed
but not configured for the job (no controller address), ``ttp`` runs its built-in engine in every worker
(saying what would switch MindIO on) and the launcher's in-place mode matches it: a lost rank is replaced,
the job ends with exit 0 and the uninterrupted run's weights. Before, the workers turned ``ttp`` and
``recover`` off while the launcher still restarted only the failed worker: the kill ended the job with
exit 1 and nothing saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import path_first
from ttp_runs import ITERS, Job, Launch, run_supervised, same_as_reference

DP2 = Launch(2)  # the shape of the shared 2-rank reference
STEP = 3


def _installed_mindio(root: Path) -> Path:
    """An importable ``mindio_ttp`` (what a MindCluster node has installed); never imported by the built-in engine."""
    package = root / "mindio_ttp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the built-in engine never imports MindIO')\n")
    return root


@pytest.fixture(scope="module")
def unconfigured(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("mindio_unconfigured")
    return run_supervised(workdir, DP2, "--save-interval", "100", FT_PLUGINS="all",
                          PYTHONPATH=path_first(_installed_mindio(workdir / "site")),
                          FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


def test_the_workers_run_the_builtin_engine_and_say_what_would_switch_mindio_on(unconfigured: Job) -> None:
    lines = unconfigured.lines("ttp enabled (engine builtin (MindIO TTP is installed but not configured: "
                               "no MindIO controller address: set TTP_ADDR")
    assert lines, unconfigured.output[-5000:]
    assert unconfigured.lines("recover enabled")


def test_the_launcher_and_the_workers_agree_and_the_lost_rank_is_replaced_in_place(unconfigured: Job,
                                                                                   reference: Job) -> None:
    assert unconfigured.returncode == 0, unconfigured.output[-5000:]
    assert unconfigured.lines("torchrun's agent restarts only a failed worker")
    assert unconfigured.lines(f"every rank stands at step {STEP}, training continues at step {STEP + 1}")
    assert not unconfigured.lines("differs from its launcher"), "the workers started with the launcher's features"
    assert unconfigured.tracker() == str(ITERS)
    assert same_as_reference(unconfigured, reference, ITERS) == []
