"""The Trainer tests again on the oldest supported transformers, 4.40.2 (set-up installs it beside the pinned 4.57):
real 2-rank torchrun runs of commits, ranges, the rotation race, every kind of damage skipped, ``ttp``'s dump and
the RNG of a resumed run, each bit-identical (the chain of faults and elastic training by restart run on the pinned
4.57 only, so that the CI's lanes fit their time). One child pytest of the pinned Trainer modules with 4.40.2 first on
the path of the tests and of every job they start (``FT_TEST_TRANSFORMERS_DIR``), so each test keeps its own
assertions; the reference run says which release it trained on (4.40 has no ``Trainer.get_batch_samples``, and
``mstx`` says once that it has no batch fetch to range)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support import OLDEST_TRANSFORMERS, PYTHON, assert_child_pytest_passes, path_first

# transformers 4.40's Trainer loads its RNG files with torch.load's default, weights_only since torch 2.6: its own
# resume fails on the pinned torch without the switch torch's error names (docs/frameworks/hf.md)
OLDEST = {**os.environ, "PYTHONPATH": path_first(OLDEST_TRANSFORMERS),
          "FT_TEST_TRANSFORMERS_DIR": str(OLDEST_TRANSFORMERS), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
HERE = Path(__file__).resolve().parent
MODULES = ("test_trainer_hooks.py", "test_trainer_runs.py", "test_trainer_ttp_rng.py", "test_resume_claims.py")


def test_the_oldest_release_is_installed_where_the_child_looks() -> None:
    probe = "import transformers; print(transformers.__version__, transformers.__file__)"
    found = subprocess.run([PYTHON, "-c", probe], env=OLDEST, capture_output=True, text=True, timeout=300)
    version, where = found.stdout.split()[-2:]
    assert version == "4.40.2" and where.startswith(str(OLDEST_TRANSFORMERS)), found.stdout + found.stderr


def test_the_trainer_tests_pass_on_the_oldest_release() -> None:
    assert_child_pytest_passes([HERE / module for module in MODULES], OLDEST, at_least=15)
