"""The Trainer tests of the 5.x line again on its first release, transformers 5.0.0 (which set-up installs beside the
pinned 4.57 and the newest 5.x), which still rotates checkpoints in the Trainer: real 2-rank torchrun runs, the
resume's skips and rotation, ``ttp``'s dump with transformers' own SIGTERM saver on, each bit-identical. One child
pytest of ``test_transformers_5.py`` pointed at 5.0.0, so each test keeps its own assertions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support import FIRST_TRANSFORMERS_5, PYTHON, assert_child_pytest_passes

FIRST = {**os.environ, "FT_TEST_TRANSFORMERS_5_DIR": str(FIRST_TRANSFORMERS_5)}


def test_the_first_5x_release_is_installed_where_the_child_looks() -> None:
    probe = "import transformers; print(transformers.__version__, transformers.__file__)"
    found = subprocess.run([PYTHON, "-c", probe], env={**os.environ, "PYTHONPATH": str(FIRST_TRANSFORMERS_5)},
                           capture_output=True, text=True, timeout=300)
    version, where = found.stdout.split()[-2:]
    assert version == "5.0.0" and where.startswith(str(FIRST_TRANSFORMERS_5)), found.stdout + found.stderr


def test_the_trainer_tests_of_the_5x_line_pass_on_its_first_release() -> None:
    assert_child_pytest_passes([Path(__file__).resolve().parent / "test_transformers_5.py"], FIRST, at_least=4)
