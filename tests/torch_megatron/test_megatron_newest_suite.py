"""The Megatron tests again on megatron-core 0.19 (set-up installs it beside the pinned 0.17.1): every module of
this folder but those written for one release (0.19's dump and replicas, the names scan, the releases' stand-ins,
Megatron-LM's refs each over its own wheel;
``tests/checkpoint/test_megatron_newer.py`` checks 0.19's own save layout, without ``common.pt``). One child pytest
with 0.19 first on the path of the tests and of every job they start, so each test keeps its own assertions;
afterwards every job's log is read: none imported the pinned release (a job given a ``PYTHONPATH`` of its own
would have). The ramp-up module ramps up with ``--step-batch-size-schedule`` there: 0.19 still takes
``--rampup-batch-size`` but no longer ramps up."""

from __future__ import annotations

import os
from pathlib import Path

from support import NEWER_MEGATRON, TRAINED_ON_0_19, assert_child_pytest_passes, first_on_path

HERE = Path(__file__).resolve().parent
NEWEST = first_on_path(NEWER_MEGATRON)
ONE_RELEASE = ("test_megatron_newer_dump.py", "test_megatron_names.py", "test_megatron_releases.py",
               "test_megatron_newest_suite.py", "test_megatron_lm_refs.py")  # the last: each ref over its own wheel


def test_the_megatron_tests_pass_on_megatron_core_0_19(tmp_path: Path) -> None:
    modules = [module for module in sorted(HERE.glob("test_*.py")) if module.name not in ONE_RELEASE]
    runs = tmp_path / "runs"
    assert_child_pytest_passes(modules, NEWEST, 197, "--basetemp", str(runs), workers=2)
    logs = {log: log.read_text() for log in runs.rglob("jobs.log")}
    assert sum(TRAINED_ON_0_19 in text for text in logs.values()) >= 30, "the jobs trained on 0.19"
    pinned = f"site-packages{os.sep}megatron{os.sep}"
    assert not [log for log, text in logs.items() if pinned in text], "a job trained on the pinned release"

