"""The MindFormers tests again on the newest MindFormers that installs beside a MindSpore the registry has: 1.9.0,
with the MindSpore it asks for (2.9.0), which set-up installs beside the pinned 1.8.0 and 2.7.2. The YAML callback
entry, the registry, ``CheckpointMonitor``'s commits, the start-up hook, the resume guard and MindFormers' own launch
path (``run_mindformer.py``'s train path, resumed twice, bit-identical to the uninterrupted run). One child pytest
with the pair first on its path (and on its runs' paths), so each test keeps its own assertions. Newer MindFormers do
not install here: 2.0 needs hyper-parallel, which no package registry holds, and 2.1.0 asks for MindSpore 2.11,
which the registry does not have.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support import NEWER_MINDFORMERS, PYTHON, assert_child_pytest_passes, first_on_path

HERE = Path(__file__).resolve().parent
MODULES = ("test_mindformers.py", "test_mindformers_resume.py")
NEWEST = first_on_path(NEWER_MINDFORMERS)


def test_the_newest_mindformers_pair_is_the_one_the_tests_import() -> None:
    found = subprocess.run([PYTHON, "-c", "import mindspore, mindformers; print(mindspore.__version__, "
                            "mindformers.__version__, mindformers.__file__)"],
                           env=NEWEST, capture_output=True, text=True, timeout=300)
    mindspore, mindformers, where = found.stdout.split()[-3:]
    assert (mindspore, mindformers) == ("2.9.0", "1.9.0"), found.stdout + found.stderr
    assert where.startswith(str(NEWER_MINDFORMERS)), where


def test_the_mindformers_tests_pass_on_mindformers_1_9() -> None:
    assert_child_pytest_passes((HERE / module for module in MODULES), NEWEST, at_least=32)
