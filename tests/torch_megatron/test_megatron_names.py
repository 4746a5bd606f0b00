"""Every megatron name ft_plugins reaches exists where each supported release keeps it: the oldest tested
(megatron-core 0.17.1, the suite's) and the newest (0.19, installed beside it). The names are read from the
package's source, so a new call site is checked without being listed here; a name that moved between
releases (``unwrap_model`` left ``megatron.training.utils`` in 0.19) turns this red."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

import ft_plugins

from support import NEWER_MEGATRON, PYTHON

GLUE = Path(ft_plugins.__file__).resolve().parent / "torch" / "megatron"
CALL = re.compile(r'megatron\("([\w.]+)"\)\.(\w+)')  # state.megatron("core.utils").unwrap_model
IMPORT = re.compile(r"from (megatron\.[\w.]+) import (\w+)")
CONSTANT = re.compile(r'^([A-Z_]+) = "(megatron\.[\w.]+)"', re.M)  # TRAINING = "megatron.training.training"
PATCH = re.compile(r'Patch\(([A-Z_]+|"megatron\.[\w.]+"), "([\w.]+)"(?![^)]*required=False)')
CHECK = """
import importlib, json, sys
missing = []
for module, dotted in json.loads(sys.argv[1]):
    try:
        owner = importlib.import_module(module)
    except Exception as error:
        missing.append(f"{module}: {type(error).__name__}: {error}")
        continue
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
    if owner is None:
        missing.append(f"{module}.{dotted}")
print(json.dumps(missing))
"""


def names_reached() -> set[tuple[str, str]]:
    """(module, dotted attribute) of every megatron name the torch glue calls, imports or patches."""
    sources = [path.read_text() for path in GLUE.glob("*.py")]
    constants = {name: module for source in sources for name, module in CONSTANT.findall(source)}
    names = {(f"megatron.{module}", attribute) for source in sources for module, attribute in CALL.findall(source)}
    names |= {(module, attribute) for source in sources for module, attribute in IMPORT.findall(source)}
    for source in sources:
        for target, attribute in PATCH.findall(source):
            module = target.strip('"') if target.startswith('"') else constants.get(target)
            if module is not None:
                names.add((module, attribute))
    return names | {(constants["OPTIMIZER"], update) for update in _updates()}


def _updates() -> tuple[str, ...]:
    """``state.UPDATES``, the optimizer methods patched by name, read without importing the glue (that
    would activate ft_plugins in the test process)."""
    tree = ast.parse((GLUE / "state.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(target, "id", None) for target in node.targets] == ["UPDATES"]]
    return ast.literal_eval(value)


def test_the_source_scan_finds_the_names_it_must() -> None:
    """A scan that found nothing would pass every release: it finds each kind of reference."""
    names = names_reached()
    assert {("megatron.core.utils", "unwrap_model"), ("megatron.training.training", "train_step"),
            ("megatron.training.checkpointing", "save_checkpoint"),
            ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.step_with_ready_grads")} <= names
    assert len(names) > 20


@pytest.mark.parametrize("release, path", [("megatron-core 0.17.1", ""), ("megatron-core 0.19", str(NEWER_MEGATRON))])
def test_every_name_exists_in_the_release(release: str, path: str) -> None:
    if path and not Path(path).is_dir():
        pytest.skip(f"{release} is not installed beside the venv (scripts/setup.sh installs it)")
    result = subprocess.run([PYTHON, "-c", CHECK, json.dumps(sorted(names_reached()))], capture_output=True,
                            text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [], release
