"""The MindFormers tests again on the newest MindFormers that installs beside a MindSpore the registry has: 1.9.0,
with the MindSpore it asks for (2.9.0), which set-up installs beside the pinned 1.8.0 and 2.7.2. The YAML callback
entry, the registry, ``CheckpointMonitor``'s commits, the start-up hook, the resume guard and MindFormers' own launch
path (``run_mindformer.py``'s train path, resumed twice, bit-identical to the uninterrupted run). One child pytest
with the pair first on its path (and on its runs' paths), so each test keeps its own assertions. Newer MindFormers do
not install here: 2.0 needs hyper-parallel, which no package registry holds, and 2.1.0 asks for MindSpore 2.11,
which the registry does not have.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from support import NEWER_MINDFORMERS, PYTHON

HERE = Path(__file__).resolve().parent
MODULES = ("test_mindformers.py", "test_mindformers_resume.py")
NEWEST = {**os.environ,
          "PYTHONPATH": os.pathsep.join(filter(None, [str(NEWER_MINDFORMERS), os.environ.get("PYTHONPATH")]))}


def test_the_newest_mindformers_pair_is_the_one_the_tests_import() -> None:
    found = subprocess.run([PYTHON, "-c", "import mindspore, mindformers; print(mindspore.__version__, "
                            "mindformers.__version__, mindformers.__file__)"],
                           env=NEWEST, capture_output=True, text=True, timeout=300)
    mindspore, mindformers, where = found.stdout.split()[-3:]
    assert (mindspore, mindformers) == ("2.9.0", "1.9.0"), found.stdout + found.stderr
    assert where.startswith(str(NEWER_MINDFORMERS)), where


def test_the_mindformers_tests_pass_on_mindformers_1_9() -> None:
    run = subprocess.run([PYTHON, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfEs",
                          *(str(HERE / module) for module in MODULES)],
                         env=NEWEST, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 32 and not re.search(r"skipped|failed|error", summary), summary
