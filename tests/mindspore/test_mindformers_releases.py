"""The MindFormers tests again on both ends of the supported range, each installed by set-up beside the pinned
1.8.0 and 2.7.2: the YAML callback entry, the registry, ``CheckpointMonitor``'s commits, the start-up hook, the
resume guard and MindFormers' own launch path (``run_mindformer.py``'s train path, resumed twice, bit-identical to
the uninterrupted run). One child pytest per release with it first on its path (and on its runs' paths), so each
test keeps its own assertions.

- Newest: 1.9.0, with the MindSpore it asks for (2.9.0). Newer MindFormers do not install here: 2.0 needs
  hyper-parallel, which no package registry holds, and 2.1.0 asks for MindSpore 2.11, which the registry does not
  have.
- Oldest: 1.6.0, with the pinned MindSpore 2.7.2: the first MindFormers that asks for a MindSpore ft_plugins
  supports (``mindspore~=2.7.0rc1``); the release before it on the registry, 1.3.2, asks for MindSpore 2.4.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import NEWER_MINDFORMERS, OLDEST_MINDFORMERS, PYTHON, assert_child_pytest_passes, first_on_path

HERE = Path(__file__).resolve().parent
MODULES = ("test_mindformers.py", "test_mindformers_resume.py")
RELEASES = {"1.9.0": (NEWER_MINDFORMERS, "2.9.0"), "1.6.0": (OLDEST_MINDFORMERS, "2.7.2")}


@pytest.mark.parametrize("mindformers", RELEASES)
def test_the_release_is_the_one_the_tests_import(mindformers: str) -> None:
    side, mindspore = RELEASES[mindformers]
    found = subprocess.run([PYTHON, "-c", "import mindspore, mindformers; print(mindspore.__version__, "
                            "mindformers.__version__, mindformers.__file__)"],
                           env=first_on_path(side), capture_output=True, text=True, timeout=300)
    assert found.stdout.split()[-3:-1] == [mindspore, mindformers], found.stdout + found.stderr
    assert found.stdout.split()[-1].startswith(str(side)), found.stdout


@pytest.mark.parametrize("mindformers", RELEASES)
def test_the_mindformers_tests_pass_on_the_release(mindformers: str) -> None:
    side, _ = RELEASES[mindformers]
    assert_child_pytest_passes((HERE / module for module in MODULES), first_on_path(side), at_least=31)
