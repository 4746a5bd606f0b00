"""``ft_plugins.launch.failures``: torchrun's process context records the workers that failed, not those it stopped
after them. Real worker processes in torch's own ``SubprocessContext``, polled and closed as torchrun's agent does;
the real job: ``tests/torch_megatron/test_report_ranks.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import wrapt

from support import PYTHON

from ft_plugins import events
from ft_plugins.config import EVENTS_JOB_VAR
from ft_plugins.launch import failures

SLEEPS = "import time; time.sleep(60)"
KILLS_ITSELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def test_the_worker_that_failed_is_recorded_once_with_its_global_rank_and_signal_not_the_one_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Global ranks 4 and 5 on this node: 5 SIGKILLs itself; torch's look finds it, stops 4 (SIGTERM) and counts
    4 as failed too; the agent's stop closes the context again."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext

    monkeypatch.setenv("FT_PLUGINS_EVENTS_DIR", str(tmp_path / "events"))
    monkeypatch.setenv(EVENTS_JOB_VAR, "j1")
    monkeypatch.setattr(events, "_recorder", None)
    monkeypatch.setattr(events, "_role", "worker")
    events.start("launcher")
    monkeypatch.setattr(PContext, "close", wrapt.FunctionWrapper(PContext.close, failures.close))
    context = start_processes("workers", PYTHON, {0: ("-c", SLEEPS), 1: ("-c", KILLS_ITSELF)},
                              {0: {"RANK": "4"}, 1: {"RANK": "5"}}, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        result = context.wait(timeout=60, period=0.05)
    finally:
        context.close()
    assert sorted(result.failures) == [0, 1], "torch counts the worker it stopped as failed too"
    [path] = (tmp_path / "events").iterdir()
    faults = [line for line in map(json.loads, path.read_text().splitlines()) if line["ev"] == "fault"]
    assert [{key: line[key] for key in ("rank", "kind", "code", "signal", "noticed")} for line in faults] == [
        {"rank": 5, "kind": "death", "code": -9, "signal": "SIGKILL", "noticed": "launcher"}]
    assert faults[0]["pid"] == result.failures[1].pid

