"""The Megatron modules marked ``newest_megatron`` on megatron-core 0.19 (set-up installs it beside the pinned
0.17.1), and on 0.19 only: elastic training, torch_dist, MoE, the overlapped parameter gather, bf16 and fp16, the
distributed optimizer's replicas and pipeline stages, the parts whose code reads most of Megatron's internals. The
pinned lane runs every other module on 0.17.1 (each Megatron module on one release, so that both lanes fit their
time); Megatron-LM's own ``pretrain_gpt.py`` at four refs covers the hooks on the older releases
(``test_megatron_lm_refs.py``), and ``tests/checkpoint/test_megatron_newer.py`` checks 0.19's own save layout,
without ``common.pt``. One child pytest with 0.19 first on the path of the tests and of every job they start, so
each test keeps its own assertions; afterwards every job's log is read: none imported the pinned release (a job
given a ``PYTHONPATH`` of its own would have)."""

from __future__ import annotations

import os
from pathlib import Path

from support import NEWER_MEGATRON, TRAINED_ON_0_19, assert_child_pytest_passes, first_on_path

HERE = Path(__file__).resolve().parent
NEWEST = first_on_path(NEWER_MEGATRON)
ONE_RELEASE = ("test_megatron_names.py", "test_megatron_releases.py", "test_megatron_newest_suite.py",
               "test_megatron_lm_refs.py")  # the last: each ref over its own wheel
MARKED = 50  # the tests of the modules marked newest_megatron


def test_the_megatron_tests_pass_on_megatron_core_0_19(tmp_path: Path) -> None:
    modules = [module for module in sorted(HERE.glob("test_*.py")) if module.name not in ONE_RELEASE]
    runs = tmp_path / "runs"
    assert_child_pytest_passes(modules, NEWEST, MARKED, "-m", "newest_megatron", "--basetemp", str(runs), workers=2)
    logs = {log: log.read_text() for log in runs.rglob("jobs.log")}
    assert sum(TRAINED_ON_0_19 in text for text in logs.values()) >= 30, "the jobs trained on 0.19"
    pinned = f"site-packages{os.sep}megatron{os.sep}"
    assert not [log for log, text in logs.items() if pinned in text], "a job trained on the pinned release"

