"""The MindSpore tests again on the newest MindSpore (2.10.0, which set-up installs beside the pinned 2.7.2):
``Model.train`` with every callback, the built-in dump and its commit, the step hook, ``ttp``'s wiring, each rank's
save committed, the sections of ``hangs`` (the real msrun jobs run on the pinned 2.7.2 only, so that the CI's
lanes fit their time). One child pytest with 2.10 first on its path (and on its jobs'), so each test keeps its own
assertions; MindFormers is not among them (the MindFormers that asks for MindSpore
2.10 needs hyper-parallel, which no package registry holds).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support import NEWER_MINDSPORE, PYTHON, assert_child_pytest_passes, first_on_path

HERE = Path(__file__).resolve().parent
MODULES = ("test_model_train.py", "test_dump.py", "test_step_hook.py", "test_ttp.py", "test_commit.py", "test_hangs.py")
NEWEST = first_on_path(NEWER_MINDSPORE)


def test_the_newest_mindspore_is_the_one_the_tests_import() -> None:
    found = subprocess.run([PYTHON, "-c", "import mindspore; print(mindspore.__version__, mindspore.__file__)"],
                           env=NEWEST, capture_output=True, text=True, timeout=300)
    version, where = found.stdout.split()[-2:]
    assert version == "2.10.0" and where.startswith(str(NEWER_MINDSPORE)), found.stdout + found.stderr


def test_the_mindspore_tests_pass_on_mindspore_2_10() -> None:
    assert_child_pytest_passes((HERE / module for module in MODULES), NEWEST, at_least=71)
